"""Triton kernels for DSV4 with plain-torch references.

`ops` holds the public entry points (Triton on CUDA, reference otherwise); `reference` is the
ground truth. Importing this package never imports triton.
"""

from .ops import (
    compressor_norm_rope_store,
    compressor_plan,
    compressor_pool,
    compressor_state_update,
    emission_metadata,
    fused_moe,
    hc_post,
    hc_pre,
    indexer_topk,
    inverse_rope_,
    moe_route,
    q_rms_rope,
    rmsnorm_rope_store,
    sparse_attn_with_sink,
    token_metadata,
    triton_available,
)

__all__ = [
    "compressor_norm_rope_store",
    "compressor_plan",
    "compressor_pool",
    "compressor_state_update",
    "emission_metadata",
    "fused_moe",
    "hc_post",
    "hc_pre",
    "indexer_topk",
    "inverse_rope_",
    "moe_route",
    "q_rms_rope",
    "rmsnorm_rope_store",
    "sparse_attn_with_sink",
    "token_metadata",
    "triton_available",
]
