"""The batch one forward pass runs on: its mode and the per-token / per-request tensors.

Kept small on purpose: model- or feature-specific state lives in typed sub-objects
(the attention backend owns its metadata; DP attention owns `DPInfo`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np
import torch

from sglang.srt.model_executor.host_to_device import to_device_async


class ForwardMode(enum.IntEnum):
    EXTEND = 1  # prefill chunks only
    DECODE = 2  # one new token per request
    MIXED = 3  # a prefill chunk plus decode requests in one pass
    IDLE = 4  # no local tokens (a DP rank that still joins collectives)

    def is_extend(self) -> bool:
        return self == ForwardMode.EXTEND

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    def is_mixed(self) -> bool:
        return self == ForwardMode.MIXED

    def is_idle(self) -> bool:
        return self == ForwardMode.IDLE

    def is_extend_or_mixed(self) -> bool:
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED)


@dataclass
class DPInfo:
    """What DP attention adds to a batch: every rank's token count for this step."""

    global_num_tokens_cpu: List[int]
    dp_rank: int = 0


@dataclass
class ForwardBatch:
    """Tokens are laid out request by request (prefill requests first, then decode rows).

    Device tensors: input_ids, positions, token_req_slot [num_tokens] (input_embeds
    [num_tokens, hidden] when given). Per-request lengths are host lists (no device sync
    needed; the metadata builder uploads what it needs in one copy). Only what the runtime
    reads is here: the KV write slots come from the page table in the metadata builder.

    `num_tokens` is the row count; on a graph's static batch (padded to its bucket) the first
    `num_live_tokens` rows belong to requests and the rest are padding. Everywhere else the
    two are equal.
    """

    forward_mode: ForwardMode
    input_ids: torch.Tensor
    positions: torch.Tensor
    token_req_slot: torch.Tensor
    seq_lens_cpu: List[int]
    extend_seq_lens_cpu: List[int]
    extend_prefix_lens_cpu: List[int]
    return_all_logits: bool = False
    input_embeds: Optional[torch.Tensor] = None
    dp: Optional[DPInfo] = None
    num_live_tokens: int = -1  # -1: every row (set by graph_batch.py on a padded static batch)

    def __post_init__(self):
        n = self.input_ids.shape[0] if self.input_embeds is None else self.input_embeds.shape[0]
        for name in ("positions", "token_req_slot"):
            assert getattr(self, name).shape[0] == n, f"{name} has {getattr(self, name).shape[0]} rows, expected {n}"
        b = len(self.seq_lens_cpu)
        assert len(self.extend_seq_lens_cpu) == b and len(self.extend_prefix_lens_cpu) == b
        assert sum(self.extend_seq_lens_cpu) <= n, "more extend tokens than input tokens"
        if self.num_live_tokens < 0:
            self.num_live_tokens = n
        assert self.num_live_tokens <= n, f"{self.num_live_tokens} live tokens in a batch of {n} rows"

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @property
    def device(self) -> torch.device:
        return self.positions.device

    def last_token_indices(self) -> torch.Tensor:
        """Row of each request's last token (where next-token logits are read)."""
        ends = torch.tensor(self.extend_seq_lens_cpu, dtype=torch.int64).cumsum(0) - 1
        return to_device_async(ends, self.device)


def build_forward_batch(
    forward_mode: ForwardMode,
    req_pool_indices: Sequence[int],
    prefix_lens: Sequence[int],
    new_token_ids: Sequence[Sequence[int]],
    device: torch.device | str,
    return_all_logits: bool = False,
    dp: Optional[DPInfo] = None,
) -> ForwardBatch:
    """Build a ForwardBatch on the host and move it to `device` in one go. The write slots
    are not gathered here: the metadata builder reads them from the page table, which must
    already map every position < prefix_len + len(new tokens) of each request."""
    assert len(req_pool_indices) == len(prefix_lens) == len(new_token_ids)
    ext = [len(t) for t in new_token_ids]
    if any(e == 0 for e in ext):
        raise ValueError("every request in a batch needs at least one new token")
    seq = [p + e for p, e in zip(prefix_lens, ext)]
    ids = torch.tensor([t for toks in new_token_ids for t in toks], dtype=torch.int64)
    pos = torch.cat(
        [torch.arange(p, s, dtype=torch.int64) for p, s in zip(prefix_lens, seq)]
    ) if ext else torch.zeros(0, dtype=torch.int64)
    if not ext:  # an idle DP rank's dummy batch: no requests, no tokens
        forward_mode = ForwardMode.IDLE
    # numpy's repeat: torch's CPU repeat_interleave wakes the OpenMP pool at any size
    tok_slot = torch.from_numpy(np.repeat(np.asarray(req_pool_indices, dtype=np.int64), ext))
    # One non-blocking upload of everything (the step's host work never waits for the GPU), then views.
    T = ids.shape[0]
    up = to_device_async(torch.cat([ids, pos, tok_slot]), torch.device(device))
    return ForwardBatch(
        forward_mode=forward_mode,
        input_ids=up[:T],
        positions=up[T:2 * T],
        token_req_slot=up[2 * T:],
        seq_lens_cpu=seq,
        extend_seq_lens_cpu=ext,
        extend_prefix_lens_cpu=list(prefix_lens),
        return_all_logits=return_all_logits,
        dp=dp,
    )
