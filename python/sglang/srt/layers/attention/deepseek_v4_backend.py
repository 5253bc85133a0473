"""DSV4 attention backend. Builds the per-batch metadata, runs the attention core for the
break op (dsv4_kernels' Triton kernel with `kernels="triton"`, its plain-torch reference with
"torch"; server_args.resolve_kernels chooses), and implements the breakable-CUDA-graph and
decode-CUDA-graph metadata hooks."""

from __future__ import annotations

import logging
from typing import Optional

import torch
from dsv4_kernels import ops as kernel_ops
from dsv4_kernels import reference as kernel_reference

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.attention.dsv4.indexer import select_topk
from sglang.srt.layers.attention.dsv4.metadata import DSV4Metadata, match_num_queries
from sglang.srt.layers.attention.dsv4.metadata_builder import build_dsv4_metadata

logger = logging.getLogger(__name__)


class DeepseekV4AttnBackend(AttentionBackend):
    use_captured_forward_metadata_for_breakable_cuda_graph = True

    def __init__(self, config, kv_pool, req_to_token_pool, max_seq_len: int, kernels: str = "torch",
                 segment_kernels: bool = False):
        if kernels not in ("torch", "triton"):
            raise ValueError(f"unknown attention kernels {kernels!r} (expected 'torch' or 'triton')")
        # The attention core is the break op: with Triton it is one launch per layer.
        self.kernels = kernels
        # The pieces inside graph segments (norms, RoPE, cache writes, compressors, indexer)
        # through dsv4_kernels ops instead of the model's own torch code.
        self.segment_kernels = segment_kernels
        self.config = config
        self.kv_pool = kv_pool
        self.req_to_token_pool = req_to_token_pool
        # Candidate-list width used whenever shapes must be static (graph capture/replay).
        self.max_seq_len = max_seq_len
        # every layer the pool holds caches for (MTP layers too, when they run)
        self.ratios = {config.layer_compress_ratio(i) for i in range(len(kv_pool.raw))} - {0}
        self.scale = config.head_dim ** -0.5
        self.forward_metadata: Optional[DSV4Metadata] = None

    def _build(self, forward_batch, static: bool, into: Optional[DSV4Metadata] = None,
               into_all: bool = False, full_graph: bool = False) -> DSV4Metadata:
        rtp = self.req_to_token_pool
        return build_dsv4_metadata(
            forward_batch,
            rtp.req_to_token,
            padding_slot=rtp.padding_slot,
            page_size=rtp.page_size,
            window=self.config.sliding_window,
            index_topk=self.config.index_topk,
            ratios=self.ratios,
            raw_staging_start=self.kv_pool.staging_start,
            raw_staging_rows=self.kv_pool.staging_rows,
            fixed_max_seq_len=self.max_seq_len if static else None,
            max_num_reqs=rtp.max_num_reqs,
            # Triton builders wherever the attention core runs on Triton (a few launches
            # instead of ~100 on every step's host path)
            use_kernels=self.kernels == "triton",
            into=into,
            into_all=into_all,
            full_graph=full_graph,
        )

    def init_forward_metadata(self, forward_batch) -> None:
        self.forward_metadata = self._build(forward_batch, static=False)

    # ---- breakable CUDA graph hooks -------------------------------------------------------
    def init_forward_metadata_for_breakable_cuda_graph_capture(self, forward_batch) -> DSV4Metadata:
        self.forward_metadata = self._build(forward_batch, static=True)
        return self.forward_metadata

    def prepare_forward_metadata_for_breakable_cuda_graph_replay(
        self, capture_metadata: DSV4Metadata, forward_batch, static_forward_batch=None
    ) -> None:
        # Build from the padded static batch so every per-token tensor has the bucket's
        # shape. The builder writes the copy fields straight into the captured storage
        # (`into`), so the refresh has nothing to copy there; it swaps in the new assign
        # fields (read by the break) and checks the static ones.
        source = forward_batch if static_forward_batch is None else static_forward_batch
        fresh = self._build(source, static=True, into=capture_metadata)
        capture_metadata.refresh_for_breakable_cuda_graph_replay_(fresh)
        self.forward_metadata = capture_metadata

    # ---- the attention core (runs eagerly, as the break op) --------------------------------
    def forward(self, q: torch.Tensor, sink: torch.Tensor, output: torch.Tensor, layer_id: int,
                num_tokens: int, index_q: Optional[torch.Tensor] = None,
                index_weights: Optional[torch.Tensor] = None, rope: Optional[tuple] = None) -> None:
        """rope (cos, sin tables): output leaves with that RoPE undone at the tokens' positions."""
        meta = self.forward_metadata
        n = num_tokens
        ratio = self.config.layer_compress_ratio(layer_id)
        a = meta.attn
        rtp = self.req_to_token_pool
        kv_b = idx_b = len_b = None
        if ratio == 4:
            if index_q is None or index_weights is None:
                raise ValueError(f"layer {layer_id} (ratio 4) needs the indexer's q and weights")
            # the indexer's top-k, here in the break, over candidates read through the page table
            live = min(n, meta.num_tokens)
            select_topk(self.config, index_q, index_weights, self.kv_pool.indexer_keys[layer_id], meta.indexer,
                        meta.page_table_list(rtp.req_to_token, 4, live, rtp.padding_slot), live,
                        kernel_ops if self.segment_kernels else None)
            kv_b = self.kv_pool.compressed[layer_id]
            idx_b = match_num_queries(meta.indexer.topk_slots, n)
            len_b = match_num_queries(meta.indexer.topk_len, n, 0)
        elif ratio == 128:
            kv_b = self.kv_pool.compressed[layer_id]
            idx_b = meta.page_table_list(rtp.req_to_token, 128, n, rtp.padding_slot)
            len_b = match_num_queries(a.c128_len, n, 0)
        raw = self.kv_pool.raw[layer_id]
        args = (q[:n], raw, match_num_queries(a.window_slots, n),
                match_num_queries(a.window_len, n, 0), kv_b, idx_b, len_b, sink, self.scale)
        out_rope = None if rope is None else (*rope, meta.positions[:n], self.config.qk_rope_head_dim)
        # Once every window of this layer is read, each request's last `window` new rows move
        # from staging into its ring, where the next steps read them. The live rows only (the
        # metadata is bucket-sized); full decode graphs capture this with the core. In a
        # decode step no window reads a row the move writes: it shares the core's launch.
        keep_rows = (self.kv_pool.staging_start, a.raw_keep_loc[:min(n, meta.num_tokens)])
        fused_keep = self.kernels == "triton" and meta.one_token_per_request
        # An FP8 KV cache (kv_pool.fp8_layout) is dequantized as its rows are gathered.
        if self.kernels == "triton":  # one launch per layer, the inverse RoPE in its stores
            kernel_ops.sparse_attn_with_sink(*args, out=output[:n], kv_layout=self.kv_pool.fp8_layout,
                                             out_rope=out_rope, keep_rows=keep_rows if fused_keep else None)
        else:  # the kernels' plain-torch reference
            kernel_reference.sparse_attn_with_sink(*args, out=output[:n], kv_layout=self.kv_pool.fp8_layout)
            if out_rope is not None:
                kernel_ops.inverse_rope_(output[:n], *out_rope)
        if not fused_keep:
            kernel_ops.keep_window_rows_(raw, *keep_rows)

    # ---- full decode CUDA graph hooks ------------------------------------------------------
    def init_forward_metadata_capture_cuda_graph(self, forward_batch) -> DSV4Metadata:
        """A decode graph captures the attention core too, so every metadata tensor is read
        inside the graph: static widths now, and an all-fields in-place copy at replay."""
        self.forward_metadata = self._build(forward_batch, static=True, full_graph=True)
        return self.forward_metadata

    def init_forward_metadata_replay_cuda_graph(self, capture_metadata: DSV4Metadata, static_forward_batch) -> None:
        # Every tensor, assign fields too, is built into the captured storage (the graph reads
        # them all); the decode refresh then finds nothing to copy and checks the static fields
        # and host widths.
        fresh = self._build(static_forward_batch, static=True, into=capture_metadata, into_all=True,
                            full_graph=True)
        capture_metadata.refresh_for_decode_cuda_graph_replay_(fresh)
        self.forward_metadata = capture_metadata

