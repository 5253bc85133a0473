"""Graph-or-eager: the one place that decides how a step runs.

A step is described by what each rank contributes (`StepInfo`); `decide_step_path` maps the
descriptions of all ranks to one `StepPath` (graph kind + bucket, or eager with a reason).
A single rank is a world of one: `ModelRunner.forward` calls it with its own description,
and DP consensus (model_executor/dp_sync.py) calls it with the all-gathered descriptions, so both
decide identically on the same batches. Pure: no tensors, no state, no side effects.
"""

from __future__ import annotations

import bisect
import enum
from dataclasses import dataclass
from typing import List, Optional, Sequence

from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode


class PathKind(enum.IntEnum):
    IDLE = 0  # no rank has work: nobody runs a forward
    EAGER = 1
    DECODE_GRAPH = 2  # full CUDA graph per batch-size bucket (decode batches)
    BREAKABLE = 3  # breakable graph per token-count bucket (extend / mixed batches)


@dataclass(frozen=True)
class StepInfo:
    """What one rank contributes to the decision; everything eligibility depends on."""

    num_tokens: int
    mode: int  # ForwardMode value, IDLE when the rank has no batch
    batch_size: int = 0
    has_input_embeds: bool = False  # decode graphs start from token ids only
    last_path: int = -1  # the path this rank took at the previous step (DP cross-check)

    def to_row(self) -> List[int]:
        return [self.num_tokens, self.mode, self.batch_size, int(self.has_input_embeds), self.last_path]

    @staticmethod
    def from_row(row: Sequence[int]) -> "StepInfo":
        return StepInfo(int(row[0]), int(row[1]), int(row[2]), bool(row[3]), int(row[4]))

    @property
    def idle(self) -> bool:
        return self.mode == ForwardMode.IDLE


def describe(fb: ForwardBatch) -> StepInfo:
    return StepInfo(fb.num_tokens, int(fb.forward_mode), fb.batch_size, fb.input_embeds is not None)


def has_inactive_dp_rank(infos: Sequence[StepInfo]) -> bool:
    """Some rank has no tokens this step (idle, or an empty batch). Such a step either
    replays with the inactive ranks padded (idle policy "replay") or runs eager on every rank
    (policy "eager"). A world of one with work is never inactive."""
    return any(i.idle or i.num_tokens == 0 for i in infos)


@dataclass(frozen=True)
class GraphTables:
    """The captured buckets (every rank has the same flags, hence the same tables)."""

    breakable_buckets: Sequence[int] = ()
    decode_bs_buckets: Sequence[int] = ()
    idle_policy: str = "replay"  # DP: "replay" (idle ranks replay with zero real tokens) or "eager"

    def __post_init__(self):
        for name in ("breakable_buckets", "decode_bs_buckets"):
            b = tuple(getattr(self, name))
            if list(b) != sorted(set(b)) or (b and b[0] < 1):
                raise ValueError(f"GraphTables.{name} must be strictly increasing positive sizes, got {b}")
            object.__setattr__(self, name, b)
        if self.idle_policy not in ("replay", "eager"):
            raise ValueError(f"GraphTables.idle_policy must be 'replay' or 'eager', got {self.idle_policy!r}")


@dataclass(frozen=True)
class StepPath:
    kind: PathKind
    # BREAKABLE: the token bucket; DECODE_GRAPH: the batch-size bucket; EAGER: the MoE pad length
    size: int
    global_num_tokens: tuple
    extend_or_mixed: bool = False  # some rank has prefill tokens (what breakable graphs are for)
    # EAGER only: why, and which graph kind would have run the step (None: no graph of that
    # kind is captured, so it is no fallback)
    reason: str = ""
    wanted: Optional[PathKind] = None

    def code(self) -> int:
        return int(self.kind) * 1_000_000 + self.size


def bucket_for(buckets: Sequence[int], n: int) -> Optional[int]:
    """Smallest bucket >= n, None when n exceeds the largest."""
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


def padding_too_wasteful(bucket: int, n: int) -> bool:
    """More padding rows than twice the real ones: the replay would cost more than eager."""
    return bucket - n > 2 * n


def eager_path(fb: ForwardBatch) -> StepPath:
    """Eager by request (references, benchmarks): not a fallback."""
    return StepPath(PathKind.EAGER, fb.num_tokens, (fb.num_tokens,), fb.forward_mode.is_extend_or_mixed(),
                    reason="requested")


def requested_eager_path(infos: Sequence[StepInfo], tables: GraphTables) -> StepPath:
    """`eager_path` for every DP rank at once, as a `decide_fn` of `dp_step` (benchmarks): eager
    by request, padded to the largest rank, not a fallback; IDLE when no rank has work."""
    tokens = tuple(i.num_tokens for i in infos)
    live = [i for i in infos if not i.idle]
    if not live:
        return StepPath(PathKind.IDLE, 0, tokens)
    extend = any(i.mode != ForwardMode.DECODE for i in live)
    return StepPath(PathKind.EAGER, max(tokens), tokens, extend, reason="requested")


def decide_step_path(infos: Sequence[StepInfo], tables: GraphTables) -> StepPath:
    """Pure function of every rank's description: every rank calls it on the same input.

    Under DP every rank is padded to the bucket of the largest rank, so bucket and padding
    rule look at the largest rank; for a world of one that is the rank itself.
    """
    tokens = tuple(i.num_tokens for i in infos)
    live = [i for i in infos if not i.idle]
    if not live:
        return StepPath(PathKind.IDLE, 0, tokens)
    max_tokens = max(tokens)
    extend = any(i.mode != ForwardMode.DECODE for i in live)
    if extend:
        kind, buckets, size = PathKind.BREAKABLE, tables.breakable_buckets, max_tokens
    else:
        kind, buckets, size = PathKind.DECODE_GRAPH, tables.decode_bs_buckets, max(i.batch_size for i in live)

    def eager(reason: str, wanted: Optional[PathKind] = kind) -> StepPath:
        return StepPath(PathKind.EAGER, max_tokens, tokens, extend, reason, wanted)

    if not buckets:
        return eager("no_graphs", None)
    if tables.idle_policy == "eager" and has_inactive_dp_rank(infos):
        return eager("inactive_dp_rank")
    if kind == PathKind.DECODE_GRAPH and any(i.has_input_embeds for i in live):
        return eager("input_embeds")
    bucket = bucket_for(buckets, size)
    if bucket is None:
        return eager("too_many_tokens" if kind == PathKind.BREAKABLE else "batch_too_large")
    if padding_too_wasteful(bucket, size):
        return eager("padding_waste")
    return StepPath(kind, bucket, tokens, extend)


# ---- bucket tables ---------------------------------------------------------------------------

def default_capture_num_tokens(max_tokens: int) -> List[int]:
    """Breakable-graph token buckets: fine-grained for small counts, coarser above;
    consecutive buckets differ by at most 2x, so padding never exceeds the real token count."""
    ladder = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 80, 96, 112, 128]
    step, n = 32, 128
    while n < max_tokens:
        if n >= 256 * (step // 32) and step < 512:
            step *= 2
        n += step
        ladder.append(n)
    return sorted({min(x, max_tokens) for x in ladder if x <= max_tokens} | {max_tokens})


def default_capture_bs(max_bs: int) -> List[int]:
    """Decode-graph batch-size buckets."""
    ladder = [1, 2, 4, 8, 12, 16, 24, 32] + list(range(48, max_bs + 1, 16))
    return sorted({b for b in ladder if b <= max_bs} | {max_bs})
