"""DeepSeek-V4: mHC residual streams, hybrid sparse attention (sliding window + c4 indexer
top-k + c128), sqrt-softplus MoE with hash-routed first layers.

Parameter names follow the checkpoint (`layers.{i}.attn.wq_a.weight`, ...) except for the
few the loader renames (stacked experts, hc_* tensors). The attention core is the only
break op of a breakable CUDA graph; everything else has static shapes and no host syncs.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.nn.functional as F
from dsv4_kernels import reference
from torch import nn

from sglang.srt.layers.attention.dsv4.compressor import Compressor
from sglang.srt.layers.attention.dsv4.indexer import Indexer
from sglang.srt.layers.layernorm import NormedInput, RMSNorm, rms_normalize
from sglang.srt.layers.mhc import HyperConnection, HyperHead
from sglang.srt.layers.moe.backends import make_fp4_backend
from sglang.srt.layers.moe.experts import DeepseekV4MoE, Fp4RoutedExperts
from sglang.srt.layers.quantization import BF16, QuantMode
from sglang.srt.layers.quantization.fp8_linear import Fp8BlockLinear, Fp8RowStack, dense_weight, make_linear
from sglang.srt.layers.rotary_embedding import RotaryTable, apply_rope_
from sglang.srt.layers.tensor_core_gemm import grouped_bf16_einsum, mm_fp32, tensor_core_eligible
from sglang.srt.model_executor.breakable_cuda_graph import register_split_op
from sglang.srt.model_executor.forward_context import get_forward_context, segment_kernel_ops

logger = logging.getLogger(__name__)


def _attention_with_output(q: torch.Tensor, sink: torch.Tensor, output: torch.Tensor, layer_id: int,
                           index_q: Optional[torch.Tensor] = None, index_weights: Optional[torch.Tensor] = None,
                           rope_cos: Optional[torch.Tensor] = None, rope_sin: Optional[torch.Tensor] = None) -> None:
    """The break op: reads the live batch from the forward context, attends with the real
    (unpadded) token count and writes every row of output[:n]; padded rows are zeroed here
    (output comes uninitialized: a fill of all rows is a full pass over [T, H, D]). On c4
    layers it first selects the indexer's top-k from index_q / index_weights (the in-segment
    half). With the RoPE tables, output leaves with the RoPE undone (in the attention's stores)."""
    ctx = get_forward_context()
    n = ctx.num_live_tokens
    rope = None if rope_cos is None else (rope_cos, rope_sin)
    ctx.attn_backend.forward(q, sink, output, layer_id, n, index_q, index_weights, rope)
    if n < output.shape[0]:
        output[n:].zero_()


deepseek_v4_attention_with_output = register_split_op(
    "deepseek_v4_attention_with_output", _attention_with_output, mutates_args=("output",),
    # per-layer activations: the graph pool reuses them layer after layer instead of keeping
    # one set per layer (model_executor/breakable_cuda_graph/intermediates.py)
    transient=("q", "output", "index_q", "index_weights"),
)


# Up to this many tokens (decode and small extends: graph buckets are fixed T, so the choice is
# static per graph), FP8 wo_a runs as one weight-only FP8 GEMM per group, reading 1 byte per
# weight element, instead of a bf16 dequantization (~7 bytes of traffic per element per step)
# and one cuBLAS bmm. Measured at Flash shapes on an H200
# (benchmark/layers/bench_tensor_core_gemm.py, docs/benchmarks.md §5): 0.062 / 0.097 / 0.165 / 0.660 ms against 0.229 / 0.234 / 0.263 /
# 0.644 ms at T = 16 / 128 / 512 / 4096; sizes between 512 and 4096 were not timed.
WO_A_FP8_GEMM_MAX_TOKENS = 512


def rope_tables_for(config, max_positions: int) -> dict:
    """The two RoPE tables every layer shares: plain (ratio 0) and YaRN (compressed layers),
    sized to the positions the runtime can reach, not the model's 1M-position maximum."""
    plain = RotaryTable(config.qk_rope_head_dim, max_positions, config.rope_theta)
    yarn = RotaryTable(config.qk_rope_head_dim, max_positions, config.compress_rope_theta, config.rope_factor,
                       config.original_max_position_embeddings, config.beta_fast, config.beta_slow)
    return {"plain": plain, "yarn": yarn}


class DeepseekV4Attention(nn.Module):
    def __init__(self, config, layer_id: int, dtype: torch.dtype, rope: RotaryTable, quant: QuantMode = BF16):
        super().__init__()
        c = config
        self.layer_id = layer_id
        self.ratio = c.layer_compress_ratio(layer_id)
        self.n_heads, self.head_dim = c.num_attention_heads, c.head_dim
        self.n_groups, self.o_lora_rank = c.o_groups, c.o_lora_rank
        self.eps = c.rms_norm_eps
        lin = lambda i, o: make_linear(i, o, dtype, quant)  # noqa: E731
        self.wq_a = lin(c.hidden_size, c.q_lora_rank)
        self.q_norm = RMSNorm(c.q_lora_rank, self.eps)
        self.wq_b = lin(c.q_lora_rank, self.n_heads * self.head_dim)
        self.wkv = lin(c.hidden_size, self.head_dim)
        self.kv_norm = RMSNorm(self.head_dim, self.eps)
        self.wo_a = lin(self.n_heads * self.head_dim // self.n_groups, self.n_groups * self.o_lora_rank)
        self.wo_b = lin(self.n_groups * self.o_lora_rank, c.hidden_size)
        self.attn_sink = nn.Parameter(torch.zeros(self.n_heads, dtype=torch.float32), requires_grad=False)
        self.compressor = Compressor(c.hidden_size, self.head_dim, self.ratio, self.eps) if self.ratio else None
        self.indexer = Indexer(c, dtype, quant) if self.ratio == 4 else None
        for p in self.parameters():
            p.requires_grad_(False)
        self.rope = rope
        self.wo_a_tensor_cores = False  # set by use_tensor_core_gemms after load
        # FP8 wo_a with whole 128-row scale blocks per group can skip the dequantization
        self.wo_a_fp8_groups = isinstance(self.wo_a, Fp8BlockLinear) and self.o_lora_rank % 128 == 0

    def stack_input_linears(self) -> None:
        """After load: the FP8 linears that read one input share a weight tensor
        (Fp8RowStack), so a decode row takes one GEMV launch for them: wq_a and wkv (the
        layer's input), wq_b and the indexer's wq_b (q_norm's output, ratio-4 layers)."""
        groups = [[self.wq_a, self.wkv]]
        if self.ratio == 4:
            groups.append([self.wq_b, self.indexer.wq_b])
        for linears in groups:
            if Fp8RowStack.stackable(linears):
                Fp8RowStack(linears)

    def use_tensor_core_gemms(self, model_dtype: torch.dtype, enabled: bool = True) -> None:
        """After load: on a bf16 model on CUDA, the grouped wo_a product on bf16 tensor cores
        (wo_a dequantized to bf16, exact while its scales are powers of two: checked here, once)
        with fp32 accumulation; otherwise the fp32 einsum."""
        ok = enabled and tensor_core_eligible(model_dtype, self.attn_sink.device)
        if ok and isinstance(self.wo_a, Fp8BlockLinear):
            ok = self.wo_a.scales_are_pow2()
        self.wo_a_tensor_cores = ok

    def forward(self, x: torch.Tensor, streams: Optional[tuple] = None) -> torch.Tensor:
        """x [T, d] -> the attention output [T, d]; with streams (residual [T, hc, d], post,
        comb from the layer's hc_pre) the mHC streams after it instead (HyperConnection.post),
        at decode in the same launch as wo_b."""
        ctx = get_forward_context()
        backend = ctx.attn_backend
        meta, pool = backend.forward_metadata, backend.kv_pool
        T = x.shape[0]
        kernels = segment_kernel_ops()
        # the kernels read the rope tables by position themselves: no lookup launches for them
        cos, sin = self.rope.lookup(meta.positions) if kernels is None else (None, None)
        rd = self.rope.rope_dim

        xin = NormedInput(x, None)  # wq_a and wkv (stacked: one GEMV launch for a decode row)
        qr = NormedInput(xin.through(self.wq_a), self.q_norm)  # q_norm applied by each consumer's linear
        q = qr.through(self.wq_b).unflatten(-1, (self.n_heads, self.head_dim))
        if kernels is not None:  # one launch: q's per-head RMS + RoPE beside kv's norm + RoPE + cache write
            kernels.q_kv_norm_rope_store(q, xin.through(self.wkv), self.kv_norm.weight, self.eps, self.rope.cos,
                                         self.rope.sin, meta.positions, rd, pool.raw[self.layer_id],
                                         meta.raw_out_loc, nope_fp8=pool.nope_fp8)
        else:
            q = rms_normalize(q, self.eps).to(x.dtype)  # per-head, weight-free
            apply_rope_(q, cos, sin)
            kv = self.kv_norm(xin.through(self.wkv))
            apply_rope_(kv, cos, sin)
            # into the token's raw staging row (the break moves the window's rows to the rings),
            # in the pool's format: FP8 rows, or nope dims FP8-rounded (release numerics)
            raw = pool.raw[self.layer_id]
            reference.scatter_rows_(raw, meta.raw_out_loc, pool.encode_kv(kv, raw))

        if self.ratio:
            state = pool.compressor_state[self.layer_id]
            self.compressor(x, meta.positions, meta.compressor(self.ratio), state,
                            pool.compressed[self.layer_id], self.rope, kernels,
                            nope_fp8=pool.nope_fp8, one_token_per_request=meta.one_token_per_request)
        index_q = index_weights = None
        if self.ratio == 4:
            istate = pool.indexer_state[self.layer_id]
            index_q, index_weights = self.indexer(x, qr, cos, sin, meta, istate, pool.indexer_keys[self.layer_id],
                                                  self.rope, kernels)

        o = torch.empty_like(q)  # the break writes every row
        if kernels is not None:  # the output's inverse RoPE in the attention's own stores
            deepseek_v4_attention_with_output(q, self.attn_sink, o, self.layer_id, index_q, index_weights,
                                              self.rope.cos, self.rope.sin)
        else:
            deepseek_v4_attention_with_output(q, self.attn_sink, o, self.layer_id, index_q, index_weights)
            apply_rope_(o, cos, sin, inverse=True)

        o = o.view(T, self.n_groups, self.n_heads * self.head_dim // self.n_groups)
        # FP8 wo_a is applied as the release does: dequantized (exact, on the fly) in the
        # grouped einsum, no activation rounding on its input. Both operands are exact in bf16,
        # so on tensor cores the products are the fp32 einsum's, accumulated in fp32.
        if self.wo_a_tensor_cores and T <= WO_A_FP8_GEMM_MAX_TOKENS and self.wo_a_fp8_groups:
            o = self.wo_a.grouped_forward(o)  # FP8 read in the GEMM: no dequantized copy
        elif self.wo_a_tensor_cores:
            wo_a = dense_weight(self.wo_a, torch.bfloat16).view(self.n_groups, self.o_lora_rank, -1)
            o = grouped_bf16_einsum(o, wo_a)
        else:
            wo_a = dense_weight(self.wo_a).view(self.n_groups, self.o_lora_rank, -1)
            o = torch.einsum("tgd,grd->tgr", o.float(), wo_a.float()).to(x.dtype)
        o = o.flatten(1)
        if streams is None:
            return self.wo_b(o)
        if kernels is not None and isinstance(self.wo_b, Fp8BlockLinear):
            return kernels.fp8_linear_hc_post(o, self.wo_b, *streams)
        return HyperConnection.post(self.wo_b(o), *streams)


class DeepseekV4DecoderLayer(nn.Module):
    def __init__(self, config, layer_id: int, dtype: torch.dtype, rope_tables: dict, quant: QuantMode = BF16,
                 expert_range=None):
        super().__init__()
        c = config
        rope = rope_tables["yarn" if c.layer_compress_ratio(layer_id) else "plain"]
        self.attn = DeepseekV4Attention(c, layer_id, dtype, rope, quant)
        self.ffn = DeepseekV4MoE(c, layer_id, dtype, quant, expert_range)
        self.attn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.ffn_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        hc = (c.hc_mult, c.hidden_size, c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps)
        self.hc_attn = HyperConnection(*hc)
        self.hc_ffn = HyperConnection(*hc)

    def forward(self, h: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        # each sub-layer returns the streams with its output written back (HyperConnection.post)
        x, post, comb = self.hc_attn.pre(h, self.attn_norm)  # x = attn_norm(mixed streams)
        h = self.attn(x, streams=(h, post, comb))
        x, post, comb = self.hc_ffn.pre(h, self.ffn_norm)
        return self.ffn(x, input_ids, streams=(h, post, comb))


class DeepseekV4MTPLayer(DeepseekV4DecoderLayer):
    """A multi-token-prediction layer (`mtp.{k}.*`): a decoder layer whose input mixes the
    target's residual streams at position p with the embedding of token p + 1, and whose
    output streams collapse through its own hc head and final norm; the logits come from
    the target's head. Its attention keeps its own caches (layer id num_hidden_layers + k in
    the KV pool) like any layer's."""

    def __init__(self, config, layer_id: int, dtype: torch.dtype, rope_tables: dict, quant: QuantMode = BF16,
                 expert_range=None):
        super().__init__(config, layer_id, dtype, rope_tables, quant, expert_range)
        c = config
        self.e_proj = make_linear(c.hidden_size, c.hidden_size, dtype, quant)
        self.h_proj = make_linear(c.hidden_size, c.hidden_size, dtype, quant)
        self.enorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hnorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hc_head = HyperHead(c.hc_mult, c.hidden_size, c.hc_eps, c.rms_norm_eps)

    def forward(self, streams: torch.Tensor, next_ids: torch.Tensor, next_embeds: torch.Tensor) -> torch.Tensor:
        """streams [T, hc, d]: the residual streams before the head (the target's last layer,
        or this layer's own output when it drafts again); next_ids [T]: the token after each
        position, next_embeds [T, d] its embedding. Returns this layer's output streams."""
        T, hc, d = streams.shape
        e = self.e_proj(self.enorm(next_embeds))
        h = self.h_proj(self.hnorm(streams).reshape(T * hc, d)).view(T, hc, d)
        return super().forward(h + e.unsqueeze(1), next_ids)

    def final_hidden(self, streams: torch.Tensor) -> torch.Tensor:
        """What the shared head reads: the streams collapsed by this layer's hc head, normed."""
        return self.norm(self.hc_head(streams))


class DeepseekV4ForCausalLM(nn.Module):
    def __init__(self, config, dtype: torch.dtype = torch.float32, max_positions: int | None = None,
                 quant_numerics: str = "release", expert_range: tuple[int, int] | None = None):
        """quant_numerics: "release" | "weight_only" (QuantMode; a bf16 config always runs
        weight_only). expert_range: the routed experts [start, end) this rank holds (DP
        attention), allocated at that size from the start; None: all."""
        super().__init__()
        c = config
        self.config = c
        self.dtype = dtype
        self.quant = quant = QuantMode.from_config(c, quant_numerics)
        self.expert_range = expert_range
        with torch.device("cpu"):  # tables computed on the host whatever the build device (to_device moves them)
            self.rope_tables = rope_tables_for(c, min(c.max_position_embeddings,
                                                      max_positions or c.max_position_embeddings))
        self.embed = nn.Embedding(c.vocab_size, c.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DeepseekV4DecoderLayer(c, i, dtype, self.rope_tables, quant, expert_range)
                                    for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hc_head = HyperHead(c.hc_mult, c.hidden_size, c.hc_eps, c.rms_norm_eps)
        self.head = nn.Linear(c.hidden_size, c.vocab_size, bias=False, dtype=torch.float32)
        n_mtp = c.num_mtp_layers
        self.mtp = nn.ModuleList(DeepseekV4MTPLayer(c, c.num_hidden_layers + k, dtype, self.rope_tables, quant,
                                                    expert_range) for k in range(n_mtp))
        for p in self.parameters():
            p.requires_grad_(False)
        # the head as bf16, derived after load when its values are bf16 (the release's are):
        # not a parameter or buffer, the loader and random init fill those by name
        self.head_bf16: torch.Tensor | None = None
        # [max tokens, hc, d]: when set (speculative decoding), every forward leaves its last
        # layer's residual streams here, the MTP layer's input (inside graphs too: a static buffer)
        self.streams_out: torch.Tensor | None = None

    def use_tensor_core_gemms(self, enabled: bool = True) -> None:
        """Post-load step (ModelRunner calls it once the weights are in place on their device):
        on a bf16 model on CUDA, the fp32 GEMMs of the layers (wo_a's grouped einsum, the
        compressors' wkv / wgate, the router's logits) move to bf16 tensor cores with the same
        products, accumulated in fp32 (layers/tensor_core_gemm.py; the compressors' fp32
        weights are replaced by three bf16 terms that hold them exactly); fp32 models and CPU
        keep the fp32 GEMMs. enabled=False restores the fp32 weights and GEMMs; a repeated call
        changes nothing. Allocates: never inside graph capture; load weights before, not after."""
        for module in list(self.layers.modules()) + list(self.mtp.modules()):
            if hasattr(module, "use_tensor_core_gemms"):
                module.use_tensor_core_gemms(self.dtype, enabled)
        self._use_bf16_head(enabled and tensor_core_eligible(self.dtype, self.head.weight.device))

    def stack_input_linears(self) -> None:
        """Post-load step (ModelRunner calls it once the weights are in place on their device):
        every attention's FP8 linears that read one input become rows of one weight tensor
        (DeepseekV4Attention.stack_input_linears), the MTP layers' too. Reallocates those
        weights: never inside graph capture; a repeated call changes nothing."""
        for module in list(self.layers.modules()) + list(self.mtp.modules()):
            if isinstance(module, DeepseekV4Attention):
                module.stack_input_linears()

    def use_moe_backend(self, name: str) -> None:
        """Post-load step (ModelRunner calls it with the resolved --moe-backend): the FP4 routed
        experts of every layer multiply with that backend from now on (layers/moe/backends/;
        humming moves the weights into its own layout here, once), the MTP layers' too; bf16
        experts keep what they have. Never inside graph capture."""
        backend = make_fp4_backend(name)  # one object: its tuned configurations are read once
        for module in list(self.layers.modules()) + list(self.mtp.modules()):
            if isinstance(module, Fp4RoutedExperts):
                module.use_backend(backend)

    def _use_bf16_head(self, want: bool) -> None:
        """The LM head on bf16 tensor cores: its fp32 weight replaced by the bf16 copy when that
        holds every value exactly (checked here, once: true of the release's BF16 head), the
        bf16 hidden times it accumulated in fp32 (mm_fp32): the fp32 GEMM's products, half its
        bytes (1 GiB less at Flash) and no CUDA-core fp32 GEMM (1.4 ms a step on an H200,
        docs/benchmarks.md §5). A head with fp32-only values keeps the fp32 GEMM."""
        w = self.head.weight
        if want and self.head_bf16 is None and w.numel():
            w_bf16 = w.detach().to(torch.bfloat16)
            # row blocks: an fp32 copy of the whole head would be another 2 GiB at Flash
            exact = all(torch.equal(wb.float(), wf) for wb, wf in zip(w_bf16.split(8192), w.detach().split(8192)))
            if not exact:
                logger.info("LM head: fp32 values a bf16 copy cannot hold, so it stays an fp32 GEMM")
                return
            self.head_bf16 = w_bf16
            w.data = w.data.new_empty((0, self.head.in_features))  # a reload fails on the shape
        elif not want and self.head_bf16 is not None:
            w.data = self.head_bf16.float()
            self.head_bf16 = None

    def to_device(self, device) -> "DeepseekV4ForCausalLM":
        self.to(device)
        for table in self.rope_tables.values():
            table.cos, table.sin = table.cos.to(device), table.sin.to(device)
        return self

    def forward(self, input_ids: torch.Tensor, input_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids [T] -> final hidden states [T, d] (after the hc head and the final norm).
        The caller runs this inside forward_context(); logits come from compute_logits."""
        # Token ids are still needed with input_embeds: hash-routed layers route by token id.
        x = self.embed(input_ids) if input_embeds is None else input_embeds.to(self.dtype)
        h = x.unsqueeze(1).repeat(1, self.config.hc_mult, 1)
        for layer in self.layers:
            h = layer(h, input_ids)
        if self.streams_out is not None:
            self.streams_out[:h.shape[0]].copy_(h)
        return self.norm(self.hc_head(h))

    def forward_mtp(self, k: int, streams: torch.Tensor, next_ids: torch.Tensor) -> tuple:
        """MTP layer k over streams [T, hc, d] and the next tokens [T]: (its output streams,
        its final hidden states [T, d] for compute_logits). Runs inside forward_context() on
        the layer's own caches."""
        layer = self.mtp[k]
        out = layer(streams, next_ids, self.embed(next_ids))
        return out, layer.final_hidden(out)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [T, vocab] of the final hidden states [T, d]."""
        if self.head_bf16 is not None:
            if hidden.dtype == torch.bfloat16:
                return mm_fp32(hidden, self.head_bf16.t())
            return F.linear(hidden.float(), self.head_bf16.float())
        return F.linear(hidden.float(), self.head.weight.float())
