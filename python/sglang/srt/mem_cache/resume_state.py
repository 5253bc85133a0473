"""What a request needs, besides its pages, to continue from a computed length L exactly as if
it had computed [0, L) itself: `ResumeState`, taken by `take_resume_state` and written back
by `restore_resume_state`. Every per-request state a resume needs is gathered here, in one
place, so a prefix cache can store and hand it out without knowing what it holds.

Pages hold the compressed entries and indexer keys of every position (a cached prefix's pages
are shared, not copied). What pages cannot hold is per request:
- Raw KV. It lives in each request slot's window ring (mem_cache/dsv4_kv_pool.py: the row of
  position p is req_slot * W + p % W, W = sliding_window), and a resumed request's first
  windows reach back to positions [L - W, L). The donor's ring holds them right after its
  forward that reached L, and is overwritten as the donor goes on, so the state copies those
  ring rows (every layer) then, and a restore writes them into the new request's ring at the
  same positions mod W. Positions below L - W are never read again.
- The compressors' ring state: for each token its projected kv and gate score, kept in a
  per-request ring of the last coff * ratio positions until the blocks reading them are
  emitted. Entry i of ratio r is emitted when position (i + 1) r - 1 is computed and pools
  positions [(i + 1 - coff) r, (i + 1) r). After L positions, the first entry still to come is
  i0 = L // r, so the positions below L that a later emission reads are [(i0 + 1 - coff) r, L):
  - ratio 4 (coff 2) at L % 4 == 0: the 4 positions [L - 4, L) (block i0 - 1, the half that
    overlaps the next entry), in the compressor's and the indexer's rings;
  - ratio 128 (coff 1) at L % 128 == 0: none (the ring's current block is empty).
  The ring rows of any other position are never read by the resumed request: the compressor's
  gather indices read a ring row only for positions below the request's computed length, and
  every position from L on is written by the resumed request's own forwards before it is read.
- Chained MTP modules' carried streams (speculative decoding with several modules): module
  j >= 1 reads module j - 1's output at the position before its first, so the state copies
  the request slot's `DSV4KVPool.mtp_carry` row (module j - 1's output at L - 1).

Bytes per state (`resume_state_bytes`): min(L, W) raw rows on every layer (a KV row: 584 B in
FP8 at head_dim 512, 1024 in bf16), plus 4 positions x 2 (kv, score) x coff * dim x 4 (fp32)
per ratio-4 layer for the compressor (dim = head_dim) and the indexer (dim = index_head_dim).
DeepSeek-V4-Flash with its default FP8 KV cache: 43 layers x 128 rows x 584 B = 3.07 MiB of
window rows + 21 ratio-4 layers x 40 KiB = 840 KiB of compressor rings, 3.89 MiB per state
(about nine times the 439 KiB of per-token KV a 128-token page of it holds). States live in
host memory (pinned on CUDA): the KV pool's plan needs no room for them, and taking or
restoring one is a set of asynchronous copies on the forward's stream.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import torch
from dsv4_kernels.kv_fp8 import kv_row_bytes

from sglang.srt.mem_cache.dsv4_kv_pool import DSV4KVPool, ring_slices


@dataclass(frozen=True)
class ResumeState:
    """Copies of a request's per-request state after `length` computed positions.
    window: the raw window-ring rows of positions [max(0, length - W), length), in position
    order, [num_layers, n, *row shape] (None for a runner without KV pools).
    rings[(kind, layer)] = (first position, kv rows, score rows) of a compressor ring, kind
    "compressor" or "indexer", rows of positions [first, length) in order.
    mtp_carry: the slot's DSV4KVPool.mtp_carry row (None without chained MTP modules)."""

    length: int
    window: Optional[torch.Tensor] = None
    rings: Dict[Tuple[str, int], Tuple[int, torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    mtp_carry: Optional[torch.Tensor] = None

    @property
    def nbytes(self) -> int:
        window = self.window.numel() * self.window.element_size() if self.window is not None else 0
        if self.mtp_carry is not None:
            window += self.mtp_carry.numel() * self.mtp_carry.element_size()
        return window + sum(kv.numel() * kv.element_size() + sc.numel() * sc.element_size()
                            for _, kv, sc in self.rings.values())


def window_positions_to_keep(length: int, window: int) -> range:
    """Positions below `length` whose raw rows a request resumed at `length` still reads."""
    return range(max(0, length - window), length)


def ring_positions_to_keep(length: int, ratio: int) -> range:
    """Positions below `length` that the compressor of `ratio` still reads after `length`."""
    coff = 2 if ratio == 4 else 1
    return range(max(0, (length // ratio + 1 - coff) * ratio), length)


def _states(kv_pool: DSV4KVPool):
    for layer, st in kv_pool.compressor_state.items():
        yield ("compressor", layer), st
    for layer, st in kv_pool.indexer_state.items():
        yield ("indexer", layer), st


def _host_buffer(shape, like: torch.Tensor) -> torch.Tensor:
    """Host memory for a state's rows: pinned on CUDA (a state is no GPU memory the plan did not
    count, and its copies never make the host wait for the GPU)."""
    return torch.empty(shape, dtype=like.dtype, pin_memory=like.device.type == "cuda")


def _copy_out(ring: torch.Tensor, parts, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The rows `parts` (slices of `ring`, in order) into host memory `out` (new when None), by
    non-blocking copies on CUDA."""
    n = sum(s.stop - s.start for s in parts)
    if out is None:
        out = _host_buffer((n, *ring.shape[1:]), ring)
    done = 0
    for s in parts:
        out[done:done + s.stop - s.start].copy_(ring[s], non_blocking=ring.device.type == "cuda")
        done += s.stop - s.start
    return out


def _copy_in(ring: torch.Tensor, parts, rows: torch.Tensor) -> None:
    """`rows` (host memory, in order) into the rows `parts` of `ring`: from pinned memory a
    non-blocking upload, ordered after the copy that took them."""
    done = 0
    for s in parts:
        n = s.stop - s.start
        ring[s].copy_(rows[done:done + n], non_blocking=True)
        done += n


def take_resume_state(kv_pool: Optional[DSV4KVPool], req_slot: int, length: int) -> ResumeState:
    """Copies of request slot `req_slot`'s state after it computed `length` positions. Only
    enqueues device copies: taken right after the forward that reached `length` was launched
    and before the next one, stream order makes it read exactly that forward's state.
    kv_pool None (a runner without KV pools): an empty state."""
    if length <= 0:
        raise ValueError(f"a resume state needs a positive length, got {length}")
    if kv_pool is None:
        return ResumeState(length=length)
    rows = kv_pool.window_rows(req_slot, window_positions_to_keep(length, kv_pool.window))
    n = sum(s.stop - s.start for s in rows)
    window = _host_buffer((len(kv_pool.raw), n, *kv_pool.raw[0].shape[1:]), kv_pool.raw[0])
    for layer, raw in enumerate(kv_pool.raw):
        _copy_out(raw, rows, window[layer])
    rings = {}
    for key, st in _states(kv_pool):
        keep = ring_positions_to_keep(length, st.ratio)
        if len(keep) == 0:
            continue
        parts = ring_slices(st.ring, keep)
        rings[key] = (keep.start, _copy_out(st.kv[req_slot], parts), _copy_out(st.score[req_slot], parts))
    carry = kv_pool.mtp_carry
    if carry is not None:
        carry = _copy_out(carry[req_slot], [slice(0, carry.shape[1])])
    return ResumeState(length=length, window=window, rings=rings, mtp_carry=carry)


def restore_resume_state(kv_pool: Optional[DSV4KVPool], req_slot: int, state: ResumeState) -> None:
    """Write `state` into request slot `req_slot`, which then continues from state.length."""
    if kv_pool is None:
        return
    rows = kv_pool.window_rows(req_slot, window_positions_to_keep(state.length, kv_pool.window))
    n = sum(s.stop - s.start for s in rows)
    if state.window is None or tuple(state.window.shape[:2]) != (len(kv_pool.raw), n):
        raise ValueError(f"resume state at {state.length} was taken from another pool layout "
                         f"(window rows {None if state.window is None else tuple(state.window.shape)})")
    for layer, raw in enumerate(kv_pool.raw):
        _copy_in(raw, rows, state.window[layer])
    for key, st in _states(kv_pool):
        keep = ring_positions_to_keep(state.length, st.ratio)
        if len(keep) == 0:
            continue
        first, kv, score = state.rings[key]
        if first != keep.start or kv.shape[0] != len(keep):
            raise ValueError(f"resume state at {state.length} was taken from another pool layout ({key})")
        parts = ring_slices(st.ring, keep)
        _copy_in(st.kv[req_slot], parts, kv)
        _copy_in(st.score[req_slot], parts, score)
    carry = kv_pool.mtp_carry
    if (carry is None) != (state.mtp_carry is None) or (carry is not None and carry.shape[1:] != state.mtp_carry.shape):
        raise ValueError(f"resume state at {state.length} was taken from another pool layout (MTP carry)")
    if carry is not None:
        _copy_in(carry[req_slot], [slice(0, carry.shape[1])], state.mtp_carry)


def resume_state_bytes(config, length: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one ResumeState taken at a page boundary `length` (what each cached prefix end
    costs) from a pool of these formats: min(length, W) raw rows on every layer and the
    compressor rings' kept positions."""
    n_raw = len(window_positions_to_keep(length, config.sliding_window))
    total = config.num_hidden_layers * n_raw * kv_row_bytes(config.head_dim, config.qk_rope_head_dim,
                                                            kv_cache_dtype, dtype)
    for layer in range(config.num_hidden_layers):
        r = config.layer_compress_ratio(layer)
        if r == 0:
            continue
        coff = 2 if r == 4 else 1
        n = len(ring_positions_to_keep(length, r))
        dims = [config.head_dim] + ([config.index_head_dim] if r == 4 else [])
        total += sum(2 * n * coff * d * 4 for d in dims)
    return total
