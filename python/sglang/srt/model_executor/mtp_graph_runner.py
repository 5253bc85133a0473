"""Graphs of the MTP layer's forwards (speculative decoding): the draft steps replay decode
graphs (one token per request) and the pass over a step's committed positions replays
breakable graphs (token-count buckets), at the target's buckets.

An MTP forward is a single decoder layer, so eagerly it is almost all host time: at Flash
dims one such forward launches about a hundred kernels, milliseconds of Python for well
under a millisecond of GPU work, several times per speculative step. The graphs read the
target's residual streams from a static buffer of their own; the attention metadata is
built and refreshed exactly as for the target's graphs of the same kind.

Only the first MTP module is captured (it is the one that drafts). Under DP attention the
graphs capture the MoE's collectives like the target's, and every rank replays the same
bucket: the speculator derives it from what all ranks agreed for the step (the largest rank's
tokens for the pass over committed positions, its requests for the draft steps), idle ranks
replaying with no live rows. With `--dp-idle-policy eager` the MTP forwards stay eager under DP.
"""

from __future__ import annotations

from typing import Dict, Sequence

import torch

from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.model_executor.graph_dispatch import GraphTables, PathKind
from sglang.srt.model_executor.graph_runner import (
    BreakableCudaGraphRunner,
    DecodeCudaGraphRunner,
    GraphRunner,
)


class _MTPGraphs:
    """What both kinds add to their target runner: the streams buffer, and the MTP layer in
    place of the target model."""

    module = 0  # the MTP module the graphs run

    def __init__(self, model_runner, buckets: Sequence[int], debug: bool = False):
        super().__init__(model_runner, buckets, debug)
        c = model_runner.config
        self.streams_in = torch.zeros(self.buckets[-1], c.hc_mult, c.hidden_size, dtype=self.model_runner.dtype,
                                      device=self.device)

    def _model_forward(self, static_fb: ForwardBatch, bucket: int):
        return self.model.forward_mtp(self.module, self.streams_in[:bucket], static_fb.input_ids)

    def replay_mtp(self, fb: ForwardBatch, streams: torch.Tensor, bucket: int) -> tuple:
        """(output streams, final hidden), each the bucket's rows: the first fb.num_tokens are
        the batch's. Padding rows keep earlier streams (finite values; nothing reads their rows)."""
        self.streams_in[:fb.num_tokens].copy_(streams)
        return self.replay_hidden(fb, bucket)


class MTPDecodeGraphRunner(_MTPGraphs, DecodeCudaGraphRunner):
    name = "mtp_decode_graph"


class MTPBreakableGraphRunner(_MTPGraphs, BreakableCudaGraphRunner):
    name = "mtp_breakable"

    def _fill(self, fb: ForwardBatch, bucket: int) -> ForwardBatch:
        # the MTP layer embeds its next-token ids inside the graph: no lookup before the replay
        return GraphRunner._fill(self, fb, bucket)


def build_mtp_graph_runners(model_runner) -> Dict[PathKind, GraphRunner]:
    """The MTP graphs the runner's flags ask for, not yet captured, at the target's buckets:
    the pass over committed positions covers prefill chunks too. One layer captures in a
    fraction of a second per bucket, and its graphs reuse the target's graph pool."""
    args, runners = model_runner.server_args, {}
    if not model_runner.num_mtp_layers or (model_runner.dp_groups is not None and args.dp_idle_policy == "eager"):
        return runners
    target = model_runner.breakable_runner
    if target is not None:
        runners[PathKind.BREAKABLE] = MTPBreakableGraphRunner(model_runner, target.buckets, debug=args.debug_cuda_graph)
    target = model_runner.decode_graph_runner
    if target is not None:
        runners[PathKind.DECODE_GRAPH] = MTPDecodeGraphRunner(model_runner, target.buckets, debug=args.debug_cuda_graph)
    return runners


def mtp_graph_tables(runners: Dict[PathKind, GraphRunner]) -> GraphTables:
    """Their buckets, for graph_dispatch.decide_step_path (empty: every MTP forward eager)."""
    b, d = runners.get(PathKind.BREAKABLE), runners.get(PathKind.DECODE_GRAPH)
    return GraphTables(breakable_buckets=b.buckets if b else (), decode_bs_buckets=d.buckets if d else ())
