"""DSV4 KV compressor (ratio 4 overlapping, or 128): softmax-gated pooling of projected
tokens into one entry per block, then RMSNorm and RoPE at the block's first position.

Incremental by construction: emissions read their source rows from this step's fresh
projections or from the per-request ring state, so chunked prefill and decode reproduce the
full-prefill entries exactly. Projections run in fp32 (the checkpoint stores them in fp32);
on a bf16 model on CUDA, after `use_tensor_core_gemms`, as one split-bf16 GEMM for wkv and
wgate together (layers/tensor_core_gemm.py: fp32 output, the fp32 weights held exactly as
three bf16 terms).
"""

from __future__ import annotations

from typing import Optional

import torch
from dsv4_kernels import reference
from torch import nn

from sglang.srt.layers.attention.dsv4.metadata import DSV4CompressorMetadata
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.rotary_embedding import RotaryTable, apply_rope_
from sglang.srt.layers.tensor_core_gemm import merge_split, split_linear, split_weight, tensor_core_eligible
from sglang.srt.mem_cache.dsv4_kv_pool import CompressorState

# Three bf16 terms hold an fp32 weight exactly (24 significant bits), so the split GEMM has the
# fp32 GEMM's products in another order, and the fp32 weights need not stay resident. Two terms
# (2^-16-relative weights, 2/3 of the FLOPs and bytes) moved release-numerics logits of
# dsv4-tiny-fp8 past fp32's own reordering noise (min cosine 0.985 vs 0.997 on CPU: FP8/FP4
# rounding and top-k flips amplify it).
SPLIT_TERMS = 3


class Compressor(nn.Module):
    def __init__(self, dim: int, head_dim: int, ratio: int, eps: float):
        super().__init__()
        self.ratio = ratio
        coff = 2 if ratio == 4 else 1
        self.wkv = nn.Linear(dim, coff * head_dim, bias=False, dtype=torch.float32)
        self.wgate = nn.Linear(dim, coff * head_dim, bias=False, dtype=torch.float32)
        self.ape = nn.Parameter(torch.zeros(ratio, coff * head_dim, dtype=torch.float32), requires_grad=False)
        self.norm = RMSNorm(head_dim, eps)
        for p in self.parameters():
            p.requires_grad_(False)
        # [wkv; wgate] as bf16 [w_hi | w_lo | w_lo2], derived after load (not a parameter or buffer:
        # the loader and random init fill parameters and buffers by name)
        self.proj_split: Optional[torch.Tensor] = None

    def use_tensor_core_gemms(self, model_dtype: torch.dtype, enabled: bool = True) -> None:
        """After the weights are loaded: on a bf16 model on CUDA (and `enabled`), split wkv +
        wgate into one bf16 operand so forward runs both projections as one tensor-core GEMM,
        and release the fp32 weights (the three terms hold them exactly: SPLIT_TERMS x 2 bytes
        per element instead of 4); otherwise drop the split, rebuilding the fp32 weights bit for
        bit. Allocates: never call inside graph capture; load weights before, not after."""
        want = enabled and tensor_core_eligible(model_dtype, self.wkv.weight.device)
        if want and self.proj_split is None:
            self.proj_split = split_weight([self.wkv.weight, self.wgate.weight], SPLIT_TERMS)
            for lin in (self.wkv, self.wgate):  # the exact split replaces them
                lin.weight.data = lin.weight.data.new_empty((0, lin.in_features))  # a reload fails on the shape
        elif not want and self.proj_split is not None:
            w = merge_split(self.proj_split, SPLIT_TERMS)
            n = self.wkv.out_features
            self.wkv.weight.data, self.wgate.weight.data = w[:n].contiguous(), w[n:].contiguous()
            self.proj_split = None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, meta: DSV4CompressorMetadata,
                state: CompressorState, pool: Optional[torch.Tensor], rope: RotaryTable,
                kernels=None, nope_fp8: bool = False, entries: Optional[torch.Tensor] = None,
                one_token_per_request: bool = False) -> None:
        """Emitted entries go to `pool` in its format (DSV4KVPool): FP8 rows for a uint8 pool;
        nope_fp8 (the pool's flag) FP8-rounds a float pool's nope dims, as the release does.
        With `entries` ([E, D], x's dtype) every emission row goes there instead, unrounded, and
        pool is not written (the indexer packs its keys from them). one_token_per_request
        (DSV4Metadata's): a decode step, whose ring update may share the pooling's launch."""
        if self.proj_split is not None:
            # one GEMM: kv | score, fp32, same row stride (what the kernels ask of the pair); a
            # decode row takes one GEMV launch (cuBLAS: a concatenation, split-K and its sum)
            if kernels is not None and kernels.bf16_gemv_takes(x, self.proj_split):
                both = kernels.bf16_gemv(x, self.proj_split)
            else:
                both = split_linear(x, self.proj_split)
            kv, score = both.split(self.wkv.out_features, dim=-1)
        else:
            xf = x.float()
            kv, score = self.wkv(xf), self.wgate(xf)
        pooled = kv.new_empty(meta.gather_idx.shape[0], self.norm.weight.shape[0])
        if kernels is not None:  # dsv4_kernels: pooling, ring update, then norm + RoPE + store
            # The kernels add the score's ape row (by position) as they read it: no launches for
            # `score + ape[p % ratio]`. token_metadata writes a ring row from one token at most
            # (a request's last R positions): no winner search.
            if self.ratio == 4:
                ring = meta.ring_write_loc if one_token_per_request else None
                # One launch for the emissions' pooling, norm, RoPE and store (FP8-aware, as the
                # KV cache-write kernel), in a decode step the ring update too, which elsewhere
                # must follow the pooling (a chunk's emissions read ring rows its later tokens
                # overwrite). Not at ratio 128: one program pooling 128 rows x 512 channels alone
                # took 44.8 us at decode on an H200, the three launches 7.
                kernels.compressor_emit(state.kv, state.score, kv, score, meta.gather_idx, self.ratio, pooled,
                                        self.norm.weight, self.norm.eps, rope.cos, rope.sin, meta.positions,
                                        rope.rope_dim, pool if entries is None else None, meta.out_loc,
                                        entries=entries, nope_fp8=nope_fp8, ape=self.ape, positions=positions,
                                        ring_write_loc=ring)
                if ring is None:
                    kernels.compressor_state_update(state.kv, state.score, kv, score, meta.ring_write_loc,
                                                    rows_unique=True, ape=self.ape, positions=positions)
                return
            # at decode the ring update shares the pooling's launch (channel tiles of both)
            ring = meta.ring_write_loc if one_token_per_request else None
            kernels.compressor_pool(state.kv, state.score, kv, score, meta.gather_idx, self.ratio, pooled,
                                    ape=self.ape, positions=positions, ring_write_loc=ring)
            if ring is None:
                kernels.compressor_state_update(state.kv, state.score, kv, score, meta.ring_write_loc,
                                                rows_unique=True, ape=self.ape, positions=positions)
            # the KV cache-write kernel (what compressor_norm_rope_store runs), FP8-aware
            kernels.rmsnorm_rope_store(pooled, self.norm.weight, self.norm.eps, rope.cos, rope.sin,
                                       meta.positions, rope.rope_dim, pool if entries is None else None,
                                       meta.out_loc, kv_out=entries, nope_fp8=nope_fp8)
            return
        score = score + self.ape[positions % self.ratio]
        reference.compressor_pool(state.kv, state.score, kv, score, meta.gather_idx, self.ratio, pooled)
        # Ring update after pooling: this step's emissions read the previous contents.
        C = kv.shape[-1]
        reference.scatter_rows_(state.kv.view(-1, C), meta.ring_write_loc, kv)
        reference.scatter_rows_(state.score.view(-1, C), meta.ring_write_loc, score)
        entry = self.norm(pooled.to(x.dtype))
        cos, sin = rope.lookup(meta.positions.long())
        apply_rope_(entry, cos, sin)
        if entries is not None:
            entries.copy_(entry)
            return
        reference.scatter_rows_(pool, meta.out_loc, reference.kv_cache_rows(entry, pool, rope.rope_dim, nope_fp8))
