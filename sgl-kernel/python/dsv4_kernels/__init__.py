"""Triton kernels for DSV4 with plain-torch references.

`ops` holds the public entry points (Triton on CUDA, reference otherwise); `reference` is the
ground truth. Importing this package never imports triton.
"""

from .ops import (
    compressor_emit,
    compressor_norm_rope_store,
    compressor_plan,
    compressor_pool,
    compressor_state_update,
    emission_metadata,
    fp4_fused_moe,
    fp4_round_blocks,
    fp8_block_linear,
    fp8_round_blocks,
    fused_moe,
    hadamard_rotate,
    hc_post,
    hc_pre,
    indexer_topk,
    inverse_rope_,
    keep_window_rows_,
    moe_route,
    q_kv_norm_rope_store,
    q_rms_rope,
    quantize_fp8_blocks,
    rmsnorm_rope_store,
    sparse_attn_with_sink,
    token_metadata,
    triton_available,
)
from .page_table_list import PageTableList

__all__ = [
    "PageTableList",
    "compressor_emit",
    "compressor_norm_rope_store",
    "compressor_plan",
    "compressor_pool",
    "compressor_state_update",
    "emission_metadata",
    "fp4_fused_moe",
    "fp4_round_blocks",
    "fp8_block_linear",
    "fp8_round_blocks",
    "fused_moe",
    "hadamard_rotate",
    "hc_post",
    "hc_pre",
    "indexer_topk",
    "inverse_rope_",
    "keep_window_rows_",
    "moe_route",
    "q_kv_norm_rope_store",
    "q_rms_rope",
    "quantize_fp8_blocks",
    "rmsnorm_rope_store",
    "sparse_attn_with_sink",
    "token_metadata",
    "triton_available",
]
