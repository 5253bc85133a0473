"""Expert-parallel token dispatch under DP attention, behind one interface.

Each DP rank holds 1/dp of the routed experts (`dp_attention.expert_shard`). A step of the MoE
is: route this rank's rows (gate, locally), `dispatch` the rows and their routing to the ranks
whose experts they need, run the local experts on what arrived, `combine` the expert outputs
back into this rank's rows (summed over the top-k, routing weights already applied).

- `GatherScatterDispatcher` (default): all-gather every rank's rows and routing into one
  buffer padded to the same length on every rank, run the local expert shard over all of it
  (other ranks' experts are skipped), reduce-scatter the partial sums back. Uniform shapes,
  so the collectives are captured inside graphs.

An all-to-all (send each row only to the ranks owning its experts, as DeepEP does) fits the
same interface; it is not offered until it exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from sglang.srt.layers.dp_attention import DPMoEContext, dp_gather, dp_reduce_scatter

MOE_DISPATCHERS = ("gather",)


@dataclass
class DispatchedTokens:
    """What the local experts run on: rows x [N, d], routing weights / global expert ids [N, k]."""

    x: torch.Tensor
    weights: torch.Tensor
    ids: torch.Tensor
    num_local: int  # this rank's live rows, which combine() returns


class MoEDispatcher:
    """dispatch -> local expert compute -> combine. Implementations must be graph-safe (static
    shapes for a given ctx.pad_tokens, no host sync) and give every rank's rows exactly the sum
    of their routed experts' outputs, each expert counted on the one rank that holds it."""

    name = "base"

    def dispatch(self, ctx: DPMoEContext, x: torch.Tensor, weights: torch.Tensor,
                 ids: torch.Tensor) -> DispatchedTokens:
        raise NotImplementedError

    def combine(self, ctx: DPMoEContext, expert_out: torch.Tensor, dispatched: DispatchedTokens) -> torch.Tensor:
        raise NotImplementedError


class GatherScatterDispatcher(MoEDispatcher):
    name = "gather"

    def dispatch(self, ctx, x, weights, ids):
        k = ids.shape[1]
        # One collective for the routing: fp32 holds expert ids exactly (< 2^24). Rows that
        # pad a rank to ctx.pad_tokens gather as zeros: expert 0 at weight 0, which adds 0.
        routing = dp_gather(torch.cat([weights.float(), ids.float()], dim=1), ctx)
        return DispatchedTokens(dp_gather(x, ctx), routing[:, :k].to(weights.dtype), routing[:, k:].to(ids.dtype),
                                x.shape[0])

    def combine(self, ctx, expert_out, dispatched):
        return dp_reduce_scatter(expert_out, dispatched.num_local, ctx)


def create_moe_dispatcher(name: str) -> MoEDispatcher:
    if name == "gather":
        return GatherScatterDispatcher()
    raise ValueError(f"--moe-dispatcher must be one of {', '.join(MOE_DISPATCHERS)}, got {name!r}")


def dispatch_and_compute(experts, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                         ctx: Optional[DPMoEContext]) -> torch.Tensor:
    """The routed experts' fp32 output for this rank's rows x [T, d]: local experts directly
    without DP, else through ctx's dispatcher around this rank's expert shard."""
    if ctx is None:
        return experts(x, weights, ids)
    d = ctx.dispatcher.dispatch(ctx, x, weights, ids)
    return ctx.dispatcher.combine(ctx, experts(d.x, d.weights, d.ids), d)
