"""DP-attention step consensus: before every forward, ranks all-gather their step
descriptions and derive the step's path from them with the one decider
(model_executor/graph_dispatch.py), so every rank takes the same path (same graph bucket,
or all eager) and the collectives around the MoE stay in step.

This exchange is the only collective a step adds. A disagreement never reaches the model's
collectives (where it would abort gloo or hang NCCL): it raises `DPConsensusError` on every
rank, naming each rank's path. Different graph tables (a mismatched configuration) are
caught always, at no per-step cost; a rank-dependent decision (a bug) is caught by the
`verify=True` (debug) all-gather of the decided path, else one step late by `last_path`.
"""

from __future__ import annotations

import logging
from typing import List, Optional, Sequence, Tuple

import torch

from sglang.srt.layers.logits_processor import LogitsOutput
from sglang.srt.model_executor.forward_batch_info import DPInfo, ForwardBatch
from sglang.srt.model_executor.graph_dispatch import (
    GraphTables,
    PathKind,
    StepInfo,
    StepPath,
    decide_step_path,
    describe,
)
from sglang.srt.model_executor.graph_tables_check import DPConsensusError, gather_graph_tables

logger = logging.getLogger(__name__)


# Eager reasons as small ints, so the debug check can name them from an int64 exchange.
EAGER_REASONS = ("", "no_graphs", "inactive_dp_rank", "input_embeds", "too_many_tokens", "batch_too_large",
                 "padding_waste", "requested")


def path_label(code: int, reason: str = "") -> str:
    """`breakable/48`, `decode_graph/4`, `eager/40 (too_many_tokens)`, `idle`; `none` before the first step."""
    if code < 0:
        return "none"
    kind, size = PathKind(code // 1_000_000), code % 1_000_000
    if kind == PathKind.IDLE:
        return "idle"
    return f"{kind.name.lower()}/{size}" + (f" ({reason})" if reason else "")


def _tables_label(t: GraphTables) -> str:
    return f"breakable {tuple(t.breakable_buckets)}, decode {tuple(t.decode_bs_buckets)}, idle policy {t.idle_policy}"


class DPStepSync:
    """Agrees one path per step across the DP ranks. Always on, at no extra collective per
    step: the ranks' `GraphTables` are all-gathered once here (construction is collective:
    every rank builds its DPStepSync at the same point), and when they differ every rank
    evaluates the decision under each rank's tables, so a step whose path would depend on
    the difference fails on every rank with `DPConsensusError` before any model collective.
    `verify` (debug) adds one tiny all-gather per step of the decided path itself, which also
    catches a decision that depends on the rank (a bug in code, not in configuration)."""

    def __init__(self, group, dp_rank: int, dp_size: int, tables: GraphTables, verify: bool = False):
        self.group = group
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.tables = tables
        self.verify = verify
        self.step = 0
        self.last_path = -1
        self.infos: List[StepInfo] = []
        self.rank_tables: List[GraphTables] = self._gather_tables() if dp_size > 1 else [tables]
        self.tables_differ = len(set(self.rank_tables)) > 1
        if self.tables_differ:
            logger.warning("DP ranks have different graph tables (%s); a step whose path depends on the "
                           "difference will fail", "; ".join(f"rank {r}: {_tables_label(t)}"
                                                             for r, t in enumerate(self.rank_tables)))

    def _gather_tables(self) -> List[GraphTables]:
        return gather_graph_tables(self.group, self.dp_size, self.tables)

    def exchange(self, local: StepInfo) -> List[StepInfo]:
        import torch.distributed as dist

        local = StepInfo(local.num_tokens, local.mode, local.batch_size, local.has_input_embeds, self.last_path)
        mine = torch.tensor(local.to_row(), dtype=torch.int64)
        out = torch.empty(self.dp_size * mine.numel(), dtype=torch.int64)
        dist.all_gather_into_tensor(out, mine, group=self.group)
        infos = [StepInfo.from_row(r) for r in out.view(self.dp_size, -1).tolist()]
        previous = {i.last_path for i in infos}
        if len(previous) > 1:  # a rank took another path last step: its collectives went astray
            self._raise(f"step {self.step - 1} (seen at step {self.step})",
                        {r: path_label(i.last_path) for r, i in enumerate(infos)})
        return infos

    def decide(self, infos: Sequence[StepInfo], decide_fn=decide_step_path) -> StepPath:
        self.infos = list(infos)  # what every rank contributed to this step (same on every rank)
        path = decide_fn(infos, self.tables)
        if self.tables_differ:
            paths = [path if t == self.tables else decide_fn(infos, t) for t in self.rank_tables]
            if len({p.code() for p in paths}) > 1:
                tables = "; ".join(f"rank {r}: {_tables_label(t)}" for r, t in enumerate(self.rank_tables))
                self._raise(f"step {self.step}", {r: path_label(p.code(), p.reason) for r, p in enumerate(paths)},
                            f"the ranks' graph tables differ ({tables}); start every rank with the same graph flags")
        if self.verify:
            self._verify(path)
        self.last_path = path.code()
        self.step += 1
        return path

    def _verify(self, path: StepPath) -> None:
        import torch.distributed as dist

        reason = EAGER_REASONS.index(path.reason) if path.reason in EAGER_REASONS else -1
        mine = torch.tensor([self.step, path.code(), reason], dtype=torch.int64)
        out = torch.empty(self.dp_size * 3, dtype=torch.int64)
        dist.all_gather_into_tensor(out, mine, group=self.group)
        rows = out.view(self.dp_size, 3).tolist()
        if len({tuple(r[:2]) for r in rows}) > 1:
            self._raise(f"step {self.step}", {r: path_label(row[1], EAGER_REASONS[row[2]] if row[2] >= 0 else "?")
                                              for r, row in enumerate(rows)},
                        "the decision depends on the rank (checked by --debug-cuda-graph)")

    def _raise(self, when: str, labels: dict, why: str = "") -> None:
        taken = ", ".join(f"rank {r} -> {label}" for r, label in labels.items())
        raise DPConsensusError(f"DP ranks disagree on the step path at {when}: {taken}" + (f"; {why}" if why else ""))


def agree_path(fb: ForwardBatch, sync: DPStepSync, decide_fn=decide_step_path) -> Optional[StepPath]:
    """The consensus half of dp_step: the step's path, or None when no rank has work."""
    path = sync.decide(sync.exchange(describe(fb)), decide_fn)
    return None if path.kind == PathKind.IDLE else path


def dp_step(model_runner, fb: ForwardBatch, sync: DPStepSync,
            decide_fn=decide_step_path) -> Tuple[StepPath, Optional[LogitsOutput]]:
    """One DP-attention step of one rank: exchange descriptions, agree the path, run it.
    Idle ranks pass an empty IDLE batch and still join every collective; the logits are
    None when no rank had work (nobody ran a forward). Used by the scheduler and the tests'
    DP harness alike; `decide_fn` exists so a test can make one rank disagree."""
    path = sync.decide(sync.exchange(describe(fb)), decide_fn)
    if path.kind == PathKind.IDLE:
        return path, None
    fb.dp = DPInfo(global_num_tokens_cpu=list(path.global_num_tokens), dp_rank=sync.dp_rank)
    return path, model_runner.forward(fb, path)
