"""DP-attention step consensus: before every forward, ranks all-gather a small vector and
derive the step's path from it with a pure function, so every rank takes the same path
(same graph bucket, or all eager) and the collectives around the MoE stay in step.

This exchange is the only collective a step adds. With `verify=True` (debug mode) a second
tiny all-gather checks that every rank really took the same decision and raises an error
naming the step and the ranks instead of letting mismatched collectives hang.
"""

from __future__ import annotations

import bisect
import enum
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from sglang.srt.model_executor.forward_batch_info import ForwardMode


class PathKind(enum.IntEnum):
    IDLE = 0  # no rank has work: nobody runs a forward
    EAGER = 1
    DECODE_GRAPH = 2
    BCG = 3


@dataclass(frozen=True)
class LocalStepInfo:
    """What a rank contributes: token count, forward mode, whether its batch could replay a
    breakable graph (no input embeds, ...), whether its batch could replay a decode graph."""

    num_tokens: int
    mode: int  # ForwardMode value, IDLE when the rank has no batch
    bcg_eligible: bool
    decode_graph_eligible: bool
    batch_size: int = 0
    last_path: int = -1  # the path this rank took at the previous step (cheap cross-check)

    def to_tensor(self) -> torch.Tensor:
        return torch.tensor([self.num_tokens, self.mode, int(self.bcg_eligible), int(self.decode_graph_eligible),
                             self.batch_size, self.last_path], dtype=torch.int64)

    @staticmethod
    def from_row(row: Sequence[int]) -> "LocalStepInfo":
        return LocalStepInfo(int(row[0]), int(row[1]), bool(row[2]), bool(row[3]), int(row[4]), int(row[5]))

    @property
    def idle(self) -> bool:
        return self.mode == ForwardMode.IDLE


@dataclass(frozen=True)
class GraphConfig:
    """The graph capabilities every rank shares (same flags, same buckets)."""

    bcg_buckets: Sequence[int] = ()
    decode_bs_buckets: Sequence[int] = ()
    idle_policy: str = "replay"  # "replay": idle ranks replay with zero real tokens; "eager"


@dataclass(frozen=True)
class StepPath:
    kind: PathKind
    # BCG: the token bucket; DECODE_GRAPH: the batch-size bucket; EAGER: the MoE pad length
    size: int
    global_num_tokens: tuple
    extend_or_mixed: bool = False  # some rank has prefill tokens (what BCG is for)

    def code(self) -> int:
        return int(self.kind) * 1_000_000 + self.size


def _bucket(buckets: Sequence[int], n: int) -> Optional[int]:
    i = bisect.bisect_left(list(buckets), n)
    return buckets[i] if i < len(buckets) else None


def decide_step_path(infos: Sequence[LocalStepInfo], cfg: GraphConfig) -> StepPath:
    """Pure function of the gathered vector: every rank calls it on the same input."""
    tokens = tuple(i.num_tokens for i in infos)
    live = [i for i in infos if not i.idle]
    if not live:
        return StepPath(PathKind.IDLE, 0, tokens)
    max_tokens = max(tokens)
    extend = any(i.mode != ForwardMode.DECODE for i in live)
    has_idle = len(live) < len(infos)
    if has_idle and cfg.idle_policy == "eager":
        return StepPath(PathKind.EAGER, max_tokens, tokens, extend)
    if not extend and all(i.decode_graph_eligible for i in live):
        bs = _bucket(cfg.decode_bs_buckets, max(i.batch_size for i in live))
        if bs is not None:
            return StepPath(PathKind.DECODE_GRAPH, bs, tokens, extend)
    if extend and all(i.bcg_eligible for i in live):
        bucket = _bucket(cfg.bcg_buckets, max_tokens)
        if bucket is not None:
            return StepPath(PathKind.BCG, bucket, tokens, extend)
    return StepPath(PathKind.EAGER, max_tokens, tokens, extend)


class DPConsensusError(RuntimeError):
    pass


class DPStepSync:
    def __init__(self, group, dp_rank: int, dp_size: int, cfg: GraphConfig, verify: bool = False):
        self.group = group
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.cfg = cfg
        self.verify = verify
        self.step = 0
        self.last_path = -1

    def exchange(self, local: LocalStepInfo) -> List[LocalStepInfo]:
        import torch.distributed as dist

        local = LocalStepInfo(local.num_tokens, local.mode, local.bcg_eligible, local.decode_graph_eligible,
                              local.batch_size, self.last_path)
        mine = local.to_tensor()
        out = torch.empty(self.dp_size * mine.numel(), dtype=torch.int64)
        dist.all_gather_into_tensor(out, mine, group=self.group)
        infos = [LocalStepInfo.from_row(r) for r in out.view(self.dp_size, -1).tolist()]
        previous = {i.last_path for i in infos}
        if len(previous) > 1:  # a rank took another path last step: its collectives went astray
            self._raise("previous step", {r: i.last_path for r, i in enumerate(infos)})
        return infos

    def decide(self, infos: Sequence[LocalStepInfo], decide_fn=decide_step_path) -> StepPath:
        path = decide_fn(infos, self.cfg)
        if self.verify:
            self._verify(path)
        self.last_path = path.code()
        self.step += 1
        return path

    def _verify(self, path: StepPath) -> None:
        import torch.distributed as dist

        mine = torch.tensor([self.step, path.code()], dtype=torch.int64)
        out = torch.empty(self.dp_size * 2, dtype=torch.int64)
        dist.all_gather_into_tensor(out, mine, group=self.group)
        rows = out.view(self.dp_size, 2).tolist()
        if len({tuple(r) for r in rows}) > 1:
            self._raise(f"step {self.step}", {r: row[1] for r, row in enumerate(rows)})

    def _raise(self, when: str, codes: dict) -> None:
        def describe(code: int) -> str:
            if code < 0:
                return "none"
            return f"{PathKind(code // 1_000_000).name.lower()}({code % 1_000_000})"

        taken = ", ".join(f"rank {r}: {describe(c)}" for r, c in codes.items())
        raise DPConsensusError(f"DP ranks disagree on the forward path at {when} (this is step {self.step}): {taken}")
