"""Graphs of the MTP layer's forwards (speculative decoding): the draft steps replay decode
graphs (one token per request) and the pass over a step's committed positions replays
breakable graphs (token-count buckets), at the target's buckets.

An MTP forward is a single decoder layer, so eagerly it is almost all host time: at Flash
dims one such forward launches about a hundred kernels, milliseconds of Python for well
under a millisecond of GPU work, several times per speculative step. The graphs read the
target's residual streams from a static buffer of their own; the attention metadata is
built and refreshed exactly as for the target's graphs of the same kind.

Every MTP module that runs has its own graphs (chained modules: speculative/mtp.py); the
modules' graphs of one kind share their input streams buffer, since a replay copies its input
in right before it runs and the forwards run one after another. Under DP attention the
graphs capture the MoE's collectives like the target's, and every rank replays the same
bucket: the speculator derives it from what all ranks agreed for the step (the largest rank's
tokens for the pass over committed positions, its requests for the draft steps), idle ranks
replaying with no live rows. With `--dp-idle-policy eager` the MTP forwards stay eager under DP.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

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

    base_name: str

    def __init__(self, model_runner, buckets: Sequence[int], debug: bool = False, module: int = 0,
                 streams_in: Optional[torch.Tensor] = None):
        self.module = module  # the MTP module the graphs run
        # module 0 keeps the plain names (stats keys mtp_breakable_replays, ...)
        self.name = self.base_name.replace("mtp", f"mtp{module}", 1) if module else self.base_name
        super().__init__(model_runner, buckets, debug)
        c = model_runner.config
        if streams_in is None:
            streams_in = torch.zeros(self.buckets[-1], c.hc_mult, c.hidden_size, dtype=self.model_runner.dtype,
                                     device=self.device)
        self.streams_in = streams_in

    def _model_forward(self, static_fb: ForwardBatch, bucket: int):
        return self.model.forward_mtp(self.module, self.streams_in[:bucket], static_fb.input_ids)

    def replay_mtp(self, fb: ForwardBatch, streams: torch.Tensor, bucket: int) -> tuple:
        """(output streams, final hidden), each the bucket's rows: the first fb.num_tokens are
        the batch's. Padding rows keep earlier streams (finite values; nothing reads their rows)."""
        self.streams_in[:fb.num_tokens].copy_(streams)
        return self.replay_hidden(fb, bucket)


class MTPDecodeGraphRunner(_MTPGraphs, DecodeCudaGraphRunner):
    base_name = "mtp_decode_graph"


class MTPBreakableGraphRunner(_MTPGraphs, BreakableCudaGraphRunner):
    base_name = "mtp_breakable"

    def _fill(self, fb: ForwardBatch, bucket: int) -> ForwardBatch:
        # the MTP layer embeds its next-token ids inside the graph: no lookup before the replay
        return GraphRunner._fill(self, fb, bucket)


def draft_step_module(step: int, num_modules: int) -> int:
    """The MTP module that runs draft step `step` (1-based forwards after the pass over
    committed positions, whose last row drafts the first token): chained modules in order, the
    last one repeating itself."""
    return min(step, num_modules - 1)


def build_mtp_graph_runners(model_runner) -> Dict[Tuple[int, PathKind], GraphRunner]:
    """The MTP graphs the runner's flags ask for, not yet captured, keyed by (module, kind), at
    the target's buckets: the pass over committed positions covers prefill chunks too. One
    layer captures in a fraction of a second per bucket, and its graphs reuse the target's
    graph pool."""
    args, runners = model_runner.server_args, {}
    if not model_runner.num_mtp_layers or (model_runner.dp_groups is not None and args.dp_idle_policy == "eager"):
        return runners
    # every module runs the pass over committed positions; the draft steps only the modules
    # speculative/mtp.py gives them (with chained modules, not the first)
    n, steps = model_runner.num_mtp_layers, args.speculative_num_steps
    kinds = ((PathKind.BREAKABLE, model_runner.breakable_runner, MTPBreakableGraphRunner, range(n)),
             (PathKind.DECODE_GRAPH, model_runner.decode_graph_runner, MTPDecodeGraphRunner,
              sorted({draft_step_module(s, n) for s in range(1, steps)})))
    for kind, target, cls, modules in kinds:
        if target is None:
            continue
        streams_in = None
        for module in modules:
            runner = cls(model_runner, target.buckets, debug=args.debug_cuda_graph, module=module,
                         streams_in=streams_in)
            runners[(module, kind)] = runner
            streams_in = runner.streams_in
    return runners


def mtp_graph_tables(runners: Dict[Tuple[int, PathKind], GraphRunner]) -> GraphTables:
    """Their buckets (every module's are the same), for graph_dispatch.decide_step_path (empty:
    every MTP forward eager)."""
    b = next((r for (_, kind), r in runners.items() if kind == PathKind.BREAKABLE), None)
    d = next((r for (_, kind), r in runners.items() if kind == PathKind.DECODE_GRAPH), None)
    return GraphTables(breakable_buckets=b.buckets if b else (), decode_bs_buckets=d.buckets if d else ())
