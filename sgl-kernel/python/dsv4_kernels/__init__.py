"""Triton kernels for DSV4 with plain-torch references.

`ops` holds the public entry points (Triton on CUDA, reference otherwise); `reference` is the
ground truth. Importing this package never imports triton.
"""

from .ops import (
    compressed_metadata,
    compressor_norm_rope_store,
    compressor_plan,
    compressor_pool,
    compressor_state_update,
    fused_moe,
    indexer_topk,
    inverse_rope_,
    moe_route,
    out_locs,
    q_rms_rope,
    rmsnorm_rope_store,
    sparse_attn_with_sink,
    triton_available,
    window_metadata,
)

__all__ = [
    "compressed_metadata",
    "compressor_norm_rope_store",
    "compressor_plan",
    "compressor_pool",
    "compressor_state_update",
    "fused_moe",
    "indexer_topk",
    "inverse_rope_",
    "moe_route",
    "out_locs",
    "q_rms_rope",
    "rmsnorm_rope_store",
    "sparse_attn_with_sink",
    "triton_available",
    "window_metadata",
]
