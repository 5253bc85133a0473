"""The batch one forward pass runs on: its mode and the per-token / per-request tensors.

Kept small on purpose: model- or feature-specific state lives in typed sub-objects
(the attention backend owns its metadata; DP attention owns `DPInfo`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import List, Optional, Sequence

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

    Device tensors: input_ids, positions, out_cache_loc, token_req_slot [num_tokens];
    req_pool_indices, seq_lens, extend_seq_lens, extend_prefix_lens [batch_size].
    The `*_cpu` lists mirror the per-request lengths on the host (no device sync needed).
    """

    forward_mode: ForwardMode
    input_ids: torch.Tensor
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    token_req_slot: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    extend_seq_lens: torch.Tensor
    extend_prefix_lens: torch.Tensor
    seq_lens_cpu: List[int]
    extend_seq_lens_cpu: List[int]
    extend_prefix_lens_cpu: List[int]
    return_all_logits: bool = False
    input_embeds: Optional[torch.Tensor] = None
    dp: Optional[DPInfo] = None
    # Set by the BCG runner on a padded static batch: how many leading tokens are real.
    num_real_tokens: Optional[int] = None

    def __post_init__(self):
        n = self.input_ids.shape[0] if self.input_embeds is None else self.input_embeds.shape[0]
        for name in ("positions", "out_cache_loc", "token_req_slot"):
            assert getattr(self, name).shape[0] == n, f"{name} has {getattr(self, name).shape[0]} rows, expected {n}"
        b = len(self.seq_lens_cpu)
        assert len(self.extend_seq_lens_cpu) == b and len(self.extend_prefix_lens_cpu) == b
        assert sum(self.extend_seq_lens_cpu) <= n, "more extend tokens than input tokens"

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @property
    def num_live_tokens(self) -> int:
        """Tokens that belong to requests (excludes BCG padding rows)."""
        return self.num_tokens if self.num_real_tokens is None else self.num_real_tokens

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
    req_to_token: torch.Tensor,
    device: torch.device | str,
    return_all_logits: bool = False,
    dp: Optional[DPInfo] = None,
) -> ForwardBatch:
    """Build a ForwardBatch on the host and move it to `device` in one go.

    `req_to_token` must already map every position < prefix_len + len(new tokens) of each
    request (the KV cache manager allocates pages before the batch is built).
    """
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
    slots = torch.tensor(list(req_pool_indices), dtype=torch.int64)
    tok_slot = torch.repeat_interleave(slots, torch.tensor(ext, dtype=torch.int64))
    per_req = torch.tensor(seq + ext + list(prefix_lens), dtype=torch.int64)  # [3 * B]
    # One non-blocking upload of everything (the step's host work never waits for the GPU),
    # then views; the write slots are gathered on the device.
    dev = torch.device(device)
    T, B = ids.shape[0], len(ext)
    up = to_device_async(torch.cat([ids, pos, tok_slot, slots, per_req]), dev)
    ids_d, pos_d, tok_d = up[:T], up[T:2 * T], up[2 * T:3 * T]
    lens_d = up[3 * T + B:].view(3, B).int()
    # Raw KV write slots keep the page table's index dtype (what the KV pools are indexed with).
    out_loc = req_to_token[tok_d.to(req_to_token.device), pos_d.to(req_to_token.device)].to(dev)
    return ForwardBatch(
        forward_mode=forward_mode,
        input_ids=ids_d,
        positions=pos_d,
        out_cache_loc=out_loc,
        token_req_slot=tok_d,
        req_pool_indices=up[3 * T:3 * T + B],
        seq_lens=lens_d[0],
        extend_seq_lens=lens_d[1],
        extend_prefix_lens=lens_d[2],
        seq_lens_cpu=seq,
        extend_seq_lens_cpu=ext,
        extend_prefix_lens_cpu=list(prefix_lens),
        return_all_logits=return_all_logits,
        dp=dp,
    )
