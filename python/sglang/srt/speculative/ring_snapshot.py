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
one request must be fewer than the smallest ring (W and R), so no two share a row.
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
        self._order: Dict[Tuple[int, int], int] = {}  # (slot, position) -> row of the saved copies
        for slot, start, n in self.spans:
            if n > self.smallest_ring(layers):
                raise ValueError(f"{n} tentative positions exceed the smallest ring ({self.smallest_ring(layers)} rows)")
            for p in range(start, start + n):
                self._order[(slot, p)] = len(self._order)
        self._tensors: List[Tuple[torch.Tensor, int]] = []  # (rows view, ring size)
        for layer in layers:
            self._tensors.append((pool.raw[layer], pool.window))
            for states in (pool.compressor_state, pool.indexer_state):
                st = states.get(layer)
                if st is not None:
                    for t in (st.kv, st.score):
                        self._tensors.append((t.view(-1, t.shape[-1]), st.ring))
        keys = list(self._order)
        # one index tensor per ring size (three at most), not one per tensor: a Flash step
        # snapshots about a hundred tensors, and each host-to-device index costs host time
        rows_of = self._rows_by_size(keys)
        self._saved = [rows[rows_of[size]] for rows, size in self._tensors]  # index_select: copies

    def smallest_ring(self, layers: Sequence[int]) -> int:
        rings = [self.pool.window] + [states[i].ring for states in (self.pool.compressor_state, self.pool.indexer_state)
                                      for i in layers if i in states]
        return min(rings)

    def _rows_by_size(self, keys: Sequence[Tuple[int, int]]) -> Dict[int, torch.Tensor]:
        out = {}
        for size in {size for _, size in self._tensors}:
            idx = torch.tensor([slot * size + p % size for slot, p in keys], dtype=torch.int64)
            out[size] = idx.to(self.pool.device, non_blocking=True)
        return out

    def restore(self, spans: Sequence[Span]) -> None:
        """Write back the rows of `spans` (each position was in the snapshot's spans)."""
        keys = [(slot, p) for slot, start, n in spans for p in range(start, start + n)]
        if not keys:
            return
        missing = [k for k in keys if k not in self._order]
        if missing:
            raise ValueError(f"positions {missing[:4]} were not in the snapshot")
        pick = torch.tensor([self._order[k] for k in keys], dtype=torch.int64).to(self.pool.device, non_blocking=True)
        rows_of = self._rows_by_size(keys)
        for (rows, size), saved in zip(self._tensors, self._saved):
            rows.index_copy_(0, rows_of[size], saved.index_select(0, pick))
