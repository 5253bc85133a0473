"""Per-layer DSV4 caches: raw (sliding-window) KV, c4 / c128 compressed KV, indexer keys,
and the per-request ring state the compressors need for incremental compression.

The compressed pools and indexer keys are indexed by slots derived from the one
request->token page table (see req_to_token_pool.py): they cost bytes per token of context.
Raw KV does not: attention reads it only inside the sliding window (W = config.sliding_window
positions), so each layer's raw tensor is

    [max_num_reqs * W ring rows | max_step_tokens staging rows]

Ring row req * W + p % W holds position p of request slot `req` once a step has finished;
a step writes every new token's raw row into staging row t (its row in the batch: a static
index, so graph segments write it without metadata that depends on the request layout). The
attention of a layer reads each query's window from staging (this step's positions) and the
ring (older ones), and then copies each request's last min(W, new tokens) staging rows into
its ring (dsv4_kernels.ops.keep_window_rows_). Staging exists for ordering: an extend longer than one
token would otherwise overwrite ring rows that its own earlier tokens still read.

Compared with a ring for the padding request (where padded rows would read and write), the
copy's targets for rows that are not kept (padding, and positions older than a request's
last W) are their own staging rows: no dummy rows, no duplicate targets in the copy, and
padded rows read nothing (empty windows). A reused request slot never reads its previous
owner's ring rows: a window reaches back only to positions >= 0 of its own request, and every
such position older than the step was written by that request's earlier steps, or, for a
request resumed from a cached prefix of length L, restored into its ring with the prefix
(positions [L - W, L): mem_cache/resume_state.py).

KV entries (raw and compressed) are rows of head_dim model-dtype values, or with
kv_cache_dtype "fp8_e4m3" uint8 rows in dsv4_kernels.kv_fp8's layout (nope dims e4m3 with a
power-of-two scale per 64, rope dims in the model dtype). `nope_fp8` tells every KV writer to
round the nope dims as the release does.

Indexer keys are rows of index_head_dim model-dtype values, or with index_keys_fp4 (release
numerics, whose keys are FP4-rounded per 32 before they are cached) uint8 rows in
dsv4_kernels.index_key_fp4's layout: e2m1 codes + one e8m0 scale per 32, 68 bytes at dim 128
instead of 256 (bf16). They hold exactly the rounded values, so the indexer scores the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
from dsv4_kernels.index_key_fp4 import IndexKeyFP4Layout, index_key_row_bytes
from dsv4_kernels.kv_fp8 import FP8KVLayout, kv_row_bytes
from dsv4_kernels.reference import kv_cache_rows

from sglang.srt.configs.deepseek_v4 import DeepseekV4Config

KV_CACHE_DTYPES = ("auto", "fp8_e4m3")


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


@dataclass
class RingStack:
    """Per-request rings of several layers in one tensor [len(layers), rows, width]: layer
    layers[j]'s row of request slot s and position p is [j, s * ring + p % ring]."""

    rows: torch.Tensor
    layers: List[int]
    ring: int


class DSV4KVPool:
    """kv_cache_dtype "auto": KV rows in `dtype`; "fp8_e4m3": FP8 rows (`fp8_layout`).
    round_nope_fp8 (release numerics): a float cache holds the nope dims FP8-rounded per 64,
    exactly the values an FP8 cache would give back. index_keys_fp4 (release numerics): the
    indexer keys are packed FP4 rows (`index_key_layout`), written by the indexer's rounding
    (ops.store_index_keys_fp4) and unpacked by its scoring."""

    def __init__(self, config: DeepseekV4Config, num_slots: int, max_num_reqs: int,
                 dtype: torch.dtype, device: torch.device | str, num_layers: Optional[int] = None,
                 kv_cache_dtype: str = "auto", round_nope_fp8: bool = False, index_keys_fp4: bool = False, *,
                 max_step_tokens: int):
        """num_slots: page-table slots (tokens of context: compressed entries and indexer keys);
        max_num_reqs: request slots (a raw ring each); max_step_tokens: the most tokens one
        forward step carries (staging rows; planning/step_tokens.py)."""
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
        if max_step_tokens < 1:
            raise ValueError(f"max_step_tokens must be positive, got {max_step_tokens}")
        self.config = config
        self.num_slots = num_slots
        self.window = config.sliding_window
        # raw rows: request rings first, then the staging rows of one step
        self.staging_start = max_num_reqs * self.window
        self.staging_rows = max_step_tokens
        self.dtype = dtype
        self.device = torch.device(device)
        self.kv_cache_dtype = kv_cache_dtype
        rope_dim = config.qk_rope_head_dim
        self.fp8_layout: Optional[FP8KVLayout] = (
            FP8KVLayout(config.head_dim, rope_dim, dtype) if kv_cache_dtype == "fp8_e4m3" else None)
        if round_nope_fp8:
            FP8KVLayout(config.head_dim, rope_dim)  # the same split must be valid
        # What every KV writer passes as nope_fp8 (an FP8 cache rounds by construction).
        self.nope_fp8 = round_nope_fp8 or self.fp8_layout is not None
        self.rope_dim = rope_dim
        self.index_key_layout: Optional[IndexKeyFP4Layout] = (
            IndexKeyFP4Layout(config.index_head_dim) if index_keys_fp4 else None)
        n_layers = config.num_hidden_layers if num_layers is None else num_layers
        D, Di = config.head_dim, config.index_head_dim
        self.raw: List[torch.Tensor] = []
        self.compressed: Dict[int, torch.Tensor] = {}
        self.indexer_keys: Dict[int, torch.Tensor] = {}
        self.compressor_state: Dict[int, CompressorState] = {}
        self.indexer_state: Dict[int, CompressorState] = {}
        rows = max_num_reqs + 1  # + the padding request
        # The per-request rings (raw window rows, compressor and indexer states) of all layers
        # of one shape are one allocation, each layer's a view of it: a speculative step's
        # rollback copies the same rows of every layer (speculative/ring_snapshot.py), one
        # gather per stack instead of one per layer and tensor.
        ratios = [config.layer_compress_ratio(layer) for layer in range(n_layers)]
        # zeros, not empty: every row read back must stay finite
        raw_stack = self._kv_rows(n_layers * (self.staging_start + self.staging_rows)).view(
            n_layers, self.staging_start + self.staging_rows, -1)
        self.raw = list(raw_stack.unbind(0))
        self.ring_stacks: List[RingStack] = [RingStack(raw_stack, list(range(n_layers)), self.window)]
        for r in sorted(set(ratios) - {0}):
            layers = [layer for layer in range(n_layers) if ratios[layer] == r]
            kinds = [(self.compressor_state, D)] + ([(self.indexer_state, Di)] if r == 4 else [])
            for states, dim in kinds:
                kv, score = _state_rings(r, dim, rows, device, len(layers))
                for j, layer in enumerate(layers):
                    states[layer] = CompressorState(r, dim, kv[j], score[j])
                ring = kv.shape[2]
                self.ring_stacks += [RingStack(t.view(len(layers), rows * ring, -1), layers, ring) for t in (kv, score)]
        for layer, r in enumerate(ratios):
            if r == 0:
                continue
            self.compressed[layer] = self._kv_rows(num_slots // r)
            if r == 4:
                self.indexer_keys[layer] = self._index_key_rows(num_slots // r)
        # Chained MTP modules (speculative decoding with several): module j >= 1 reads module
        # j - 1's output streams one position back, so each request slot keeps module j - 1's
        # output at its last computed position, [slots + 1, modules - 1, hc, d] (zeros: a
        # request's first position reads no earlier one).
        chained = max(0, n_layers - config.num_hidden_layers - 1)
        self.mtp_carry: Optional[torch.Tensor] = torch.zeros(
            rows, chained, config.hc_mult, config.hidden_size, dtype=dtype, device=self.device) if chained else None

    def window_rows(self, req_slot: int, positions: range) -> List[slice]:
        """The rows of every layer's raw tensor that hold `positions` (at most W consecutive
        ones) in request slot `req_slot`'s window ring, as at most two contiguous slices in
        position order."""
        num_rings = self.staging_start // self.window
        if not 0 <= req_slot < num_rings:
            raise ValueError(f"request slot {req_slot} has no window ring (slots 0..{num_rings - 1})")
        if len(positions) > self.window or positions.step != 1:
            raise ValueError(f"a window ring holds at most {self.window} consecutive positions, got {positions}")
        base = req_slot * self.window
        return [slice(base + s.start, base + s.stop) for s in ring_slices(self.window, positions)]

    def copy_page(self, src: int, dst: int, page_size: int) -> None:
        """Page `dst` of every paged cache (compressed entries, indexer keys) becomes a copy of
        page `src`: what a request resumed inside a cached prefix's partial page starts from.
        Enqueued on the current stream (no host sync, graph-free: between steps)."""
        for layer, rows in list(self.compressed.items()) + list(self.indexer_keys.items()):
            n = page_size // self.config.layer_compress_ratio(layer)
            rows[dst * n:(dst + 1) * n].copy_(rows[src * n:(src + 1) * n])

    def _kv_rows(self, n: int) -> torch.Tensor:
        if self.fp8_layout is not None:  # all-zero bytes read back as 0.0 (scale 2^-127)
            return torch.zeros(n, self.fp8_layout.row_bytes, dtype=torch.uint8, device=self.device)
        return torch.zeros(n, self.config.head_dim, dtype=self.dtype, device=self.device)

    def _index_key_rows(self, n: int) -> torch.Tensor:
        if self.index_key_layout is not None:  # all-zero bytes read back as 0.0
            return torch.zeros(n, self.index_key_layout.row_bytes, dtype=torch.uint8, device=self.device)
        return torch.zeros(n, self.config.index_head_dim, dtype=self.dtype, device=self.device)

    def decode_index_keys(self, pool: torch.Tensor) -> torch.Tensor:
        """An indexer-key pool's rows as values [N, index_head_dim] (fp32 for packed rows; for
        tests and tools)."""
        return self.index_key_layout.unpack(pool) if self.index_key_layout is not None else pool

    def encode_kv(self, rows: torch.Tensor, pool: torch.Tensor) -> torch.Tensor:
        """KV rows [T, head_dim] as `pool` (a raw or compressed pool of this object) stores
        them: FP8 rows, nope-rounded, or as they are. Static shapes, no host sync."""
        return kv_cache_rows(rows, pool, self.rope_dim, self.nope_fp8)

    def decode_kv(self, pool: torch.Tensor) -> torch.Tensor:
        """A KV pool's rows as values [N, head_dim] (fp32 for FP8 rows; for tests and tools)."""
        return self.fp8_layout.unpack(pool) if self.fp8_layout is not None else pool

    def bytes_per_token(self) -> float:
        """KV bytes one token of this pool costs (kv_bytes_per_token at its formats)."""
        return kv_bytes_per_token(self.config, self.dtype, self.kv_cache_dtype, self.index_key_layout is not None,
                                  len(self.raw))

    def nbytes(self) -> int:
        ts = list(self.raw) + list(self.compressed.values()) + list(self.indexer_keys.values())
        for st in list(self.compressor_state.values()) + list(self.indexer_state.values()):
            ts += [st.kv, st.score]
        if self.mtp_carry is not None:
            ts.append(self.mtp_carry)
        return sum(t.numel() * t.element_size() for t in ts)


def ring_slices(size: int, positions: range) -> List[slice]:
    """Offsets of consecutive `positions` (at most `size`) in a ring of `size` rows where
    position p sits at p % size: at most two contiguous slices, in position order (slices, not
    an index tensor: copying them needs no host-to-device upload)."""
    out, q = [], positions.start
    while q < positions.stop:
        lo = q % size
        n = min(positions.stop - q, size - lo)
        out.append(slice(lo, lo + n))
        q += n
    return out


def _state_rings(ratio: int, dim: int, rows: int, device, num_layers: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """kv and score rings of num_layers layers, stacked: [num_layers, rows, R, coff * dim] fp32
    each (R = coff * ratio); scores start at -inf, the empty ring."""
    coff = 2 if ratio == 4 else 1
    shape = (num_layers, rows, coff * ratio, coff * dim)
    return (torch.zeros(shape, dtype=torch.float32, device=device),
            torch.full(shape, float("-inf"), dtype=torch.float32, device=device))


def kv_bytes_per_token(config: DeepseekV4Config, dtype: torch.dtype, kv_cache_dtype: str = "auto",
                       index_keys_fp4: bool = False, num_layers: Optional[int] = None) -> float:
    """KV bytes one token of context costs across layers, mirroring DSV4KVPool's layout: 1/r of
    a compressed entry on ratio-r layers (and of an indexer key on ratio-4 layers: a packed FP4
    row with index_keys_fp4, else index_head_dim model-dtype values). Raw KV costs nothing per
    token (raw_window_bytes: per request slot and per step token). num_layers: the layers the
    pool holds (default the decoder layers; running MTP layers follow them)."""
    row = kv_row_bytes(config.head_dim, config.qk_rope_head_dim, kv_cache_dtype, dtype)
    key = index_key_row_bytes(config.index_head_dim, index_keys_fp4, dtype)
    total = 0.0
    for layer in range(config.num_hidden_layers if num_layers is None else num_layers):
        r = config.layer_compress_ratio(layer)
        if r:
            total += row / r
        if r == 4:
            total += key / 4
    return total


def raw_ring_bytes_per_request(config: DeepseekV4Config, dtype: torch.dtype, kv_cache_dtype: str = "auto",
                               num_layers: Optional[int] = None) -> int:
    """Bytes of one request slot's raw-KV rings: W = sliding_window rows on every layer."""
    n_layers = config.num_hidden_layers if num_layers is None else num_layers
    row = kv_row_bytes(config.head_dim, config.qk_rope_head_dim, kv_cache_dtype, dtype)
    return n_layers * config.sliding_window * row


def raw_window_bytes(config: DeepseekV4Config, dtype: torch.dtype, kv_cache_dtype: str, max_num_reqs: int,
                     max_step_tokens: int, num_layers: Optional[int] = None) -> int:
    """Bytes of DSV4KVPool's raw tensors: every request slot's rings plus the staging rows of
    one step, on every layer. Independent of the context length and of the token count."""
    n_layers = config.num_hidden_layers if num_layers is None else num_layers
    row = kv_row_bytes(config.head_dim, config.qk_rope_head_dim, kv_cache_dtype, dtype)
    return (max_num_reqs * raw_ring_bytes_per_request(config, dtype, kv_cache_dtype, n_layers)
            + n_layers * max_step_tokens * row)

