"""The expert-parallel MoE dispatch harness (layers/moe/ep_dispatch.py): seeded dsv4-tiny MoE
blocks identical in every process, uneven rows per rank (one idle at dp 4), and the rank body
that holds one shard of the experts and runs both MoE paths through the dispatcher."""

from __future__ import annotations

import gc
import os

import torch

from sglang.test.dp_harness import errors_to

EP_LAYERS = (0, 1)  # dsv4-tiny: layer 0 routes by hash table, layer 1 by top-k


def ep_tokens(rank: int, world: int) -> int:
    """Uneven rows per rank; at dp=4 one rank is idle (0 rows) and still joins every collective."""
    return [5, 0, 9, 3][rank] if world == 4 else [7, 4][rank]


def ep_inputs(seed: int, rank: int, world: int, dim: int, vocab: int):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    n = ep_tokens(rank, world)
    return torch.randn(n, dim, generator=g), torch.randint(0, vocab, (n,), generator=g)


def ep_moe_layers(seed: int):
    """Seeded dsv4-tiny MoE blocks, identical in every process."""
    from sglang.srt.configs.presets import get_preset
    from sglang.srt.layers.moe.experts import DeepseekV4MoE

    config = get_preset("dsv4-tiny")
    torch.manual_seed(seed)
    layers = {}
    for layer_id in EP_LAYERS:
        moe = DeepseekV4MoE(config, layer_id, torch.float32)
        for p in moe.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
        if moe.gate.tid2eid is not None:
            moe.gate.tid2eid.copy_(torch.randint(0, config.n_routed_experts, moe.gate.tid2eid.shape))
        layers[layer_id] = moe
    return config, layers


class _KernelsSwitch:
    """Stands in for the attention backend: only `segment_kernels` is read by the MoE."""

    def __init__(self, on: bool):
        self.segment_kernels = on


def ep_moe_forward(moe, x, input_ids, segment_kernels: bool, dp_moe=None) -> torch.Tensor:
    from sglang.srt.model_executor.forward_context import forward_context

    with forward_context(None, _KernelsSwitch(segment_kernels), num_live_tokens=x.shape[0], dp_moe=dp_moe):
        return moe(x, input_ids)


def ep_rank_main(rank: int, world: int, port: int, seed: int, out_dir: str) -> None:
    """One of `world` rank processes. For dp = world and every smaller power of two (ranks
    [0, dp) in a subgroup), hold experts [start, end) of a dp-way split only, run both MoE
    paths through the dispatcher, save this rank's outputs (or the error text)."""
    torch.set_num_threads(1)
    with errors_to(os.path.join(out_dir, f"ep{rank}.err")):
        import torch.distributed as dist

        from sglang.srt.distributed.parallel_state import destroy_dp_groups, init_dp_groups
        from sglang.srt.layers.dp_attention import DPMoEContext, expert_shard
        from sglang.srt.layers.moe.ep_dispatch import create_moe_dispatcher

        groups = init_dp_groups(rank, world, f"tcp://127.0.0.1:{port}", torch.device("cpu"), 60.0)
        sizes = [world >> i for i in range(world.bit_length()) if world >> i >= 2]
        # new_group is collective: every rank creates every subgroup, members or not
        subgroups = {dp: groups.device_group if dp == world else dist.new_group(list(range(dp))) for dp in sizes}
        out = {}
        for dp, group in subgroups.items():
            if rank >= dp:
                continue
            config, layers = ep_moe_layers(seed)
            start, end = expert_shard(config.n_routed_experts, rank, dp)
            for moe in layers.values():
                moe.experts.keep_shard_(start, end)
            x, ids = ep_inputs(seed, rank, dp, config.hidden_size, config.vocab_size)
            pad = max(ep_tokens(r, dp) for r in range(dp))
            ctx = DPMoEContext(group, rank, dp, pad, create_moe_dispatcher("gather"))
            out[dp, "held"] = (start, end, layers[1].experts.w1.shape[0])
            with torch.inference_mode():
                for layer_id, moe in layers.items():
                    for kernels in (False, True):
                        out[dp, layer_id, kernels] = ep_moe_forward(moe, x, ids, kernels, ctx)
        torch.save(out, os.path.join(out_dir, f"ep{rank}.pt"))
        del groups, subgroups
        gc.collect()
        destroy_dp_groups()
