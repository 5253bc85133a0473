"""Per-layer DSV4 caches: raw (sliding-window) KV, c4 / c128 compressed KV, indexer keys,
and the per-request ring state the compressors need for incremental compression.

All pools are indexed by slots derived from the one request->token page table
(see req_to_token_pool.py). Every raw token is kept (simple; see docs/architecture.md for
the memory cost at long context and the ring alternative we left for later).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from sglang.srt.configs.deepseek_v4 import DeepseekV4Config


@dataclass
class CompressorState:
    """Ring of the last R = coff * ratio positions of each request: kv and score (ape added)."""

    ratio: int
    dim: int
    kv: torch.Tensor  # [num_req_slots + 1, R, coff * dim] fp32
    score: torch.Tensor  # same shape, fp32

    @property
    def ring(self) -> int:
        return self.kv.shape[1]


class DSV4KVPool:
    def __init__(self, config: DeepseekV4Config, num_slots: int, max_num_reqs: int,
                 dtype: torch.dtype, device: torch.device | str, num_layers: Optional[int] = None):
        self.config = config
        self.num_slots = num_slots
        self.dtype = dtype
        self.device = torch.device(device)
        n_layers = config.num_hidden_layers if num_layers is None else num_layers
        D, Di = config.head_dim, config.index_head_dim
        self.raw: List[torch.Tensor] = []
        self.compressed: Dict[int, torch.Tensor] = {}
        self.indexer_keys: Dict[int, torch.Tensor] = {}
        self.compressor_state: Dict[int, CompressorState] = {}
        self.indexer_state: Dict[int, CompressorState] = {}
        rows = max_num_reqs + 1  # + the padding request
        for layer in range(n_layers):
            r = config.layer_compress_ratio(layer)
            # zeros, not empty: padded rows may read these and must stay finite
            self.raw.append(torch.zeros(num_slots, D, dtype=dtype, device=device))
            if r == 0:
                continue
            self.compressed[layer] = torch.zeros(num_slots // r, D, dtype=dtype, device=device)
            self.compressor_state[layer] = _new_state(r, D, rows, device)
            if r == 4:
                self.indexer_keys[layer] = torch.zeros(num_slots // r, Di, dtype=dtype, device=device)
                self.indexer_state[layer] = _new_state(r, Di, rows, device)

    def nbytes(self) -> int:
        ts = list(self.raw) + list(self.compressed.values()) + list(self.indexer_keys.values())
        for st in list(self.compressor_state.values()) + list(self.indexer_state.values()):
            ts += [st.kv, st.score]
        return sum(t.numel() * t.element_size() for t in ts)


def _new_state(ratio: int, dim: int, rows: int, device) -> CompressorState:
    coff = 2 if ratio == 4 else 1
    shape = (rows, coff * ratio, coff * dim)
    return CompressorState(
        ratio=ratio,
        dim=dim,
        kv=torch.zeros(shape, dtype=torch.float32, device=device),
        score=torch.full(shape, float("-inf"), dtype=torch.float32, device=device),
    )
