"""Undo for tentative positions: the ring rows a speculative step overwrites.

What a step at position p writes, and whether a rejected p must be undone:
- compressed entries and indexer keys (page-table slots): an entry is read only once its
  block is complete, and the block a rejected position completed is written again when the
  accepted tokens complete it. Nothing to undo.
- the raw window ring row slot * W + p % W (DSV4KVPool): it held position p - W, which the
  next W positions still read. Undone.
- each compressor's and indexer's state ring row slot * R + p % R (R = 8 on ratio-4 layers,
  whose blocks overlap the previous one, 128 on ratio-128 layers): it held p - R, which the
  next emission may read. Undone.

A snapshot copies those rows for a list of (request slot, positions) before the step and
writes back the ones whose positions were rejected afterwards; the accepted positions keep
what the step wrote, which is what a step without speculation would have left. Positions of
one request must be fewer than the smallest ring (W and R), so no two share a row. The pool
keeps each kind of ring of all layers in one tensor (a ring stack), so a snapshot is a few
gathers, not one per layer and tensor (a hundred at Flash dims, milliseconds of host time).
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch

from sglang.srt.mem_cache.dsv4_kv_pool import DSV4KVPool

Span = Tuple[int, int, int]  # (request slot, first position, number of positions)


class RingSnapshot:
    def __init__(self, pool: DSV4KVPool, layers: Sequence[int], spans: Sequence[Span]):
        """Copies the rows `spans` will overwrite on `layers` (layer ids of pool)."""
        self.pool = pool
        self.spans = list(spans)
        self._order: Dict[Tuple[int, int], int] = {}  # (slot, position) -> index among the saved positions
        for slot, start, n in self.spans:
            if n > self.smallest_ring(layers):
                raise ValueError(f"{n} tentative positions exceed the smallest ring ({self.smallest_ring(layers)} rows)")
            for p in range(start, start + n):
                self._order[(slot, p)] = len(self._order)
        # per ring stack of the pool (dsv4_kv_pool.RingStack): the rows of `layers`, a
        # contiguous range of its layers, flattened to [layers * rows, width]
        wanted = set(layers)
        self._stacks: List[Tuple[torch.Tensor, int, int]] = []  # (rows view, rows per layer, ring)
        for st in pool.ring_stacks:
            js = [j for j, layer in enumerate(st.layers) if layer in wanted]
            if not js:
                continue
            a, b = js[0], js[-1] + 1
            if js != list(range(a, b)):
                raise ValueError(f"layers {sorted(wanted)} are not a contiguous range of a ring stack")
            per = st.rows.shape[1]
            self._stacks.append((st.rows[a:b].reshape((b - a) * per, -1), per, st.ring))
        self._saved = [rows[idx] for (rows, _, _), idx in zip(self._stacks, self._indices(list(self._order)))]

    def smallest_ring(self, layers: Sequence[int]) -> int:
        rings = [self.pool.window] + [states[i].ring for states in (self.pool.compressor_state, self.pool.indexer_state)
                                      for i in layers if i in states]
        return min(rings)

    def _indices(self, keys: Sequence[Tuple[int, int]]) -> List[torch.Tensor]:
        """Per stack, the flat rows of keys on each of its layers (layer-major). Built with
        tensor ops from one row per key: a Python loop over layers x keys costs milliseconds
        of host time at large batches."""
        slots = torch.tensor([slot for slot, _ in keys], dtype=torch.int64)
        positions = torch.tensor([p for _, p in keys], dtype=torch.int64)
        out = []
        for rows, per, ring in self._stacks:
            idx = _per_layer(slots * ring + positions % ring, rows.shape[0] // per, per)
            out.append(idx.to(self.pool.device, non_blocking=True))
        return out

    def restore(self, spans: Sequence[Span]) -> None:
        """Write back the rows of `spans` (each position was in the snapshot's spans)."""
        keys = [(slot, p) for slot, start, n in spans for p in range(start, start + n)]
        if not keys:
            return
        missing = [k for k in keys if k not in self._order]
        if missing:
            raise ValueError(f"positions {missing[:4]} were not in the snapshot")
        order = torch.tensor([self._order[k] for k in keys], dtype=torch.int64)
        for (rows, per, _), idx, saved in zip(self._stacks, self._indices(keys), self._saved):
            pick = _per_layer(order, rows.shape[0] // per, len(self._order))
            rows.index_copy_(0, idx, saved.index_select(0, pick.to(self.pool.device, non_blocking=True)))


def _per_layer(rows: torch.Tensor, num_layers: int, stride: int) -> torch.Tensor:
    """rows repeated for each layer, layer j's shifted by j * stride (layer-major, flat)."""
    return (torch.arange(num_layers, dtype=torch.int64)[:, None] * stride + rows[None, :]).flatten()
