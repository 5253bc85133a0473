"""What a request needs, besides its pages, to continue from a computed length L exactly as if
it had computed [0, L) itself: `ResumeState`, taken by `take_resume_state` and written back
by `restore_resume_state`. Every per-request state a resume needs is gathered here, in one
place, so a prefix cache can store and hand it out without knowing what it holds.

Pages hold everything positional: raw KV of every token, compressed entries and indexer keys
(a cached prefix's pages are shared, not copied). What pages cannot hold is the compressors'
ring state: for each token its projected kv and gate score, kept in a per-request ring of the
last coff * ratio positions until the blocks reading them are emitted. Entry i of ratio r is
emitted when position (i + 1) r - 1 is computed and pools positions [(i + 1 - coff) r,
(i + 1) r). After L positions, the first entry still to come is i0 = L // r, so the positions
below L that a later emission reads are [(i0 + 1 - coff) r, L):
- ratio 4 (coff 2) at L % 4 == 0: the 4 positions [L - 4, L) (block i0 - 1, the half that
  overlaps the next entry), in the compressor's and the indexer's rings;
- ratio 128 (coff 1) at L % 128 == 0: none (the ring's current block is empty).
The ring rows of any other position are never read by the resumed request: the compressor's
gather indices read a ring row only for positions below the request's computed length, and
every position from L on is written by the resumed request's own forwards before it is read.

Bytes per state: 4 positions x 2 (kv, score) x coff * dim x 4 (fp32) per ratio-4 layer, for
the compressor (dim = head_dim) and the indexer (dim = index_head_dim); `resume_state_bytes`.
DeepSeek-V4-Flash: 21 ratio-4 layers x 40 KiB = 840 KiB per state (a 128-token page of its
bf16 KV is 6.2 MiB). States live in host memory (pinned on CUDA): the KV pool's plan needs no
room for them, and taking or restoring one is an asynchronous copy on the forward's stream.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import torch

from sglang.srt.mem_cache.dsv4_kv_pool import CompressorState, DSV4KVPool


@dataclass(frozen=True)
class ResumeState:
    """Copies of a request's per-request state after `length` computed positions.
    rings[(kind, layer)] = (first position, kv rows, score rows) of a compressor ring, kind
    "compressor" or "indexer", rows of positions [first, length) in order."""

    length: int
    rings: Dict[Tuple[str, int], Tuple[int, torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(kv.numel() * kv.element_size() + sc.numel() * sc.element_size()
                   for _, kv, sc in self.rings.values())


def ring_positions_to_keep(length: int, ratio: int) -> range:
    """Positions below `length` that the compressor of `ratio` still reads after `length`."""
    coff = 2 if ratio == 4 else 1
    return range(max(0, (length // ratio + 1 - coff) * ratio), length)


def _states(kv_pool: DSV4KVPool):
    for layer, st in kv_pool.compressor_state.items():
        yield ("compressor", layer), st
    for layer, st in kv_pool.indexer_state.items():
        yield ("indexer", layer), st


def _ring_slices(st: CompressorState, keep: range):
    """The ring rows of positions `keep` as at most two contiguous slices, in position order
    (slices, not an index tensor: no host-to-device copy, so no wait for the forward in flight)."""
    out, q = [], keep.start
    while q < keep.stop:
        lo = q % st.ring
        n = min(keep.stop - q, st.ring - lo)
        out.append(slice(lo, lo + n))
        q += n
    return out


def _copy_out(ring: torch.Tensor, parts) -> torch.Tensor:
    """The ring rows `parts` in host memory: pinned, filled by non-blocking copies, on CUDA (a
    state is no GPU memory the plan did not count, and the host never waits for the GPU)."""
    n = sum(s.stop - s.start for s in parts)
    on_cuda = ring.device.type == "cuda"
    out = torch.empty((n, *ring.shape[1:]), dtype=ring.dtype, pin_memory=on_cuda)
    done = 0
    for s in parts:
        out[done:done + s.stop - s.start].copy_(ring[s], non_blocking=on_cuda)
        done += s.stop - s.start
    return out


def take_resume_state(kv_pool: Optional[DSV4KVPool], req_slot: int, length: int) -> ResumeState:
    """Copies of request slot `req_slot`'s state after it computed `length` positions. Only
    enqueues device copies: taken right after the forward that reached `length` was launched
    and before the next one, stream order makes it read exactly that forward's state.
    kv_pool None (a runner without KV pools): an empty state."""
    if length <= 0:
        raise ValueError(f"a resume state needs a positive length, got {length}")
    rings = {}
    if kv_pool is not None:
        for key, st in _states(kv_pool):
            keep = ring_positions_to_keep(length, st.ratio)
            if len(keep) == 0:
                continue
            parts = _ring_slices(st, keep)
            rings[key] = (keep.start, _copy_out(st.kv[req_slot], parts), _copy_out(st.score[req_slot], parts))
    return ResumeState(length=length, rings=rings)


def restore_resume_state(kv_pool: Optional[DSV4KVPool], req_slot: int, state: ResumeState) -> None:
    """Write `state` into request slot `req_slot`, which then continues from state.length."""
    if kv_pool is None:
        return
    for key, st in _states(kv_pool):
        keep = ring_positions_to_keep(state.length, st.ratio)
        if len(keep) == 0:
            continue
        first, kv, score = state.rings[key]
        assert first == keep.start and kv.shape[0] == len(keep), "resume state taken by another layout"
        done = 0
        for s in _ring_slices(st, keep):
            n = s.stop - s.start
            # from pinned host memory: a non-blocking upload, ordered after the copy that took it
            st.kv[req_slot, s].copy_(kv[done:done + n], non_blocking=True)
            st.score[req_slot, s].copy_(score[done:done + n], non_blocking=True)
            done += n


def resume_state_bytes(config, page_size: int) -> int:
    """Bytes of one ResumeState taken at a page boundary (what each cached prefix end costs)."""
    total = 0
    for layer in range(config.num_hidden_layers):
        r = config.layer_compress_ratio(layer)
        if r == 0:
            continue
        coff = 2 if r == 4 else 1
        n = len(ring_positions_to_keep(page_size, r))
        dims = [config.head_dim] + ([config.index_head_dim] if r == 4 else [])
        total += sum(2 * n * coff * d * 4 for d in dims)
    return total
