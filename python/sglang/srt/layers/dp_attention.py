"""Collectives around the MoE under DP attention: every rank's rows are gathered into a
buffer padded to the same length on every rank (uniform, so the collective can be captured),
and partial results are reduce-scattered back (summing the expert shards). The MoE reaches
them through its dispatcher (layers/moe/ep_dispatch.py); `expert_shard` says which experts a
rank holds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    # The dispatchers are built on these collectives; the context only carries one.
    from sglang.srt.layers.moe.ep_dispatch import MoEDispatcher


@dataclass
class DPMoEContext:
    group: object
    dp_rank: int
    dp_size: int
    pad_tokens: int  # rows every rank contributes (max local tokens, or the graph bucket)
    dispatcher: MoEDispatcher  # chosen once by --moe-dispatcher (ep_dispatch.create_moe_dispatcher)


def dp_gather(x: torch.Tensor, ctx: DPMoEContext) -> torch.Tensor:
    import torch.distributed as dist

    n = x.shape[0]
    if n < ctx.pad_tokens:  # eager steps: pad to the common length (graphs are already padded)
        x = torch.cat([x, x.new_zeros(ctx.pad_tokens - n, x.shape[1])])
    out = x.new_empty(ctx.pad_tokens * ctx.dp_size, x.shape[1])
    dist.all_gather_into_tensor(out, x.contiguous(), group=ctx.group)
    return out


def dp_reduce_scatter(full: torch.Tensor, num_local: int, ctx: DPMoEContext) -> torch.Tensor:
    import torch.distributed as dist

    if full.device.type == "cpu":
        # gloo's reduce-scatter reduces into an internal buffer and copies it out inside
        # Work.wait(); that copy is dispatched as an op of its own, which the CPU graph
        # emulator would record and replay with the capture-time buffer. An in-place
        # all-reduce has no such hidden copy; on CPU the extra bytes do not matter.
        full = full.contiguous()
        dist.all_reduce(full, group=ctx.group)
        start = ctx.dp_rank * ctx.pad_tokens
        return full[start:start + num_local]
    out = full.new_empty(ctx.pad_tokens, full.shape[1])
    dist.reduce_scatter_tensor(out, full.contiguous(), group=ctx.group)
    return out[:num_local]


def expert_shard(n_experts: int, dp_rank: int, dp_size: int) -> tuple:
    if n_experts % dp_size:
        raise ValueError(f"n_routed_experts ({n_experts}) must be divisible by dp-size ({dp_size})")
    per = n_experts // dp_size
    return dp_rank * per, (dp_rank + 1) * per
