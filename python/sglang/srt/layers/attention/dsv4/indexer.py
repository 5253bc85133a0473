"""DSV4 lightning indexer (c4 layers): scores every visible c4 entry with
I(t,s) = sum_h w(t,h) relu(q_I(t,h) . K_I(s)) and keeps the top-k.

Two halves. `Indexer.forward` runs inside graph segments (static shapes): q_I, the head
weights w, and the indexer compressor's key writes. `select_topk` runs in the eager attention
break, over the candidates read through the page table (a PageTableList as wide as the live
batch's longest list), in chunks of query tokens (widths.py): nothing of it is captured and
no per-token candidate list is materialized, so nothing grows with the context length but
the bounded working set of one chunk."""

from __future__ import annotations

import torch
from dsv4_kernels import reference
from dsv4_kernels.page_table_list import PageTableList
from torch import nn

from sglang.srt.layers.attention.dsv4.compressor import Compressor
from sglang.srt.layers.attention.dsv4.widths import indexer_chunk_tokens
from sglang.srt.layers.quantization import BF16, QuantMode
from sglang.srt.layers.quantization.fp8_linear import make_linear
from sglang.srt.layers.rotary_embedding import apply_rope_


def _rotate_round(t: torch.Tensor) -> torch.Tensor:
    from dsv4_kernels.ops import fp4_round_blocks, hadamard_rotate

    return fp4_round_blocks(hadamard_rotate(t)).to(t.dtype)


class Indexer(nn.Module):
    def __init__(self, config, dtype: torch.dtype, quant: QuantMode = BF16):
        super().__init__()
        self.n_heads, self.head_dim = config.index_n_heads, config.index_head_dim
        # Release numerics: q and the compressed keys are Walsh-Hadamard rotated, then rounded
        # to FP4 per 32, as the release's indexer kernels see them.
        self.fp4_qk = quant.release_numerics
        self.wq_b = make_linear(config.q_lora_rank, self.n_heads * self.head_dim, dtype, quant)
        self.weights_proj = nn.Linear(config.hidden_size, self.n_heads, bias=False, dtype=dtype)
        self.weight_scale = self.head_dim ** -0.5 * self.n_heads ** -0.5
        self.compressor = Compressor(config.hidden_size, self.head_dim, 4, config.rms_norm_eps)
        for p in self.parameters():
            p.requires_grad_(False)

    def forward(self, x, qr, cos, sin, meta, state, key_pool, rope, kernels=None) -> tuple[torch.Tensor, torch.Tensor]:
        """qr: the attention's q_lora with its norm (layernorm.NormedInput).
        The in-segment half: writes this step's indexer keys; returns (q_I [T, nH, D] with
        RoPE, w [T, nH] fp32) for `select_topk` in the attention break. Release numerics:
        q_I and the written keys Hadamard-rotated and FP4-rounded (the rotation keeps dot
        products; the rounding is the release's); a uint8 key_pool stores the keys packed
        (e2m1 + e8m0 per 32, index_key_fp4.py), which holds those rounded values exactly."""
        q = qr.through(self.wq_b).unflatten(-1, (self.n_heads, self.head_dim))
        if kernels is not None:  # RoPE, and the rotation + FP4 rounding, in one launch
            kernels.indexer_rope_rotate_round_(q, rope.cos, rope.sin, meta.positions, rope.rope_dim, self.fp4_qk)
        else:
            apply_rope_(q, cos, sin)
            if self.fp4_qk:
                q = _rotate_round(q)
        if key_pool.dtype == torch.uint8:  # packed FP4 keys (DSV4KVPool.index_key_layout)
            if not self.fp4_qk:
                raise ValueError("packed FP4 indexer keys hold FP4-rounded keys: they need release numerics")
            # this step's emissions, then rotated, rounded and packed straight into their rows
            # (padded emissions, -1, are not stored)
            out_loc = meta.c4_compressor.out_loc
            entries = x.new_empty(out_loc.shape[0], self.head_dim)
            self.compressor(x, meta.positions, meta.c4_compressor, state, None, rope, kernels, entries=entries,
                            one_token_per_request=meta.one_token_per_request)
            (kernels or reference).store_index_keys_fp4(entries, key_pool, out_loc)
        else:
            self.compressor(x, meta.positions, meta.c4_compressor, state, key_pool, rope, kernels,
                            one_token_per_request=meta.one_token_per_request)
        if self.fp4_qk and key_pool.dtype != torch.uint8:
            # The keys this step emitted, in place and still inside the segment, before the
            # break's select_topk reads them: each entry is written once, so each is rotated
            # and rounded exactly once (padded emissions, -1, go to trash row 0).
            loc = meta.c4_compressor.out_loc.long().clamp(min=0)
            keys = key_pool.index_select(0, loc)
            keys = (kernels.indexer_rope_rotate_round_(keys, None, None, None, 0) if kernels is not None
                    else _rotate_round(keys))
            key_pool.index_copy_(0, loc, keys)
        w = self.weights_proj.weight
        if kernels is not None and kernels.bf16_gemv_takes(x, w):  # a decode row: one launch, not four
            return q, kernels.bf16_gemv(x, w, self.weight_scale, round_bf16=True)
        return q, self.weights_proj(x).float() * self.weight_scale


def select_topk(config, q: torch.Tensor, w: torch.Tensor, key_pool: torch.Tensor, im,
                cands: PageTableList, num_tokens: int, kernels=None) -> None:
    """The eager half: im.topk_slots[:num_tokens] <- the top-k c4 slots of each live token over
    its candidates `cands` (entries i < im.cand_len, read through the page table), a bounded
    chunk of tokens at a time: the Triton kernel reads the page table itself, the torch
    reference gathers the chunk's lists. q and the keys arrive as the in-segment half left
    them (rotated and FP4-rounded in release numerics; packed FP4 keys are unpacked as the
    candidates are gathered)."""
    step = indexer_chunk_tokens(config, cands.width, kernels is not None)
    for s in range(0, num_tokens, step):
        e = min(num_tokens, s + step)
        # logits (Triton kernel or the torch reference) + deterministic top-k straight into
        # the produced buffer
        (kernels or reference).indexer_topk(q[s:e], w[s:e], key_pool, cands[s:e], im.cand_len[s:e],
                                            im.topk, im.topk_slots[s:e])
