"""Memory planner: how one GPU's memory divides between weights, KV pool, graph pool and
activations, from the model config and the serving settings alone (no device needed).

`plan_memory` gives a `MemoryPlan` per GPU; the KV pool is what `--mem-fraction-static` of the
free memory leaves after the weights and the fixed per-request state, and the rest of the free
memory must hold the graph pool and the activation reserve. When something does not fit it
raises `MemoryPlanError` naming the shortfall in GiB and the flag to change, so a server
refuses at start-up instead of running out of memory mid-serving. `min_gpus_to_fit` answers
"how many GPUs does this model need" (tests: DeepSeek-V4-Flash 2 x H200, Pro 8).

Weight bytes come from the model itself built on the meta device (planning/meta_model.py):
every tensor's shape and the dtype it is held in. A release-format config builds the quantized
modules the loader fills (layers/quantization: FP8 linears 1 B per element + an fp32 scale per
128 x 128 block; FP4 routed experts 0.5 B per element + 1 B per 32), so their storage is
counted as held, not re-derived. KV bytes per token are the pool's own count (dsv4_kv_pool.kv_bytes_per_token:
compressed entries and indexer keys); raw KV is a fixed term, each request slot's window rings plus
the staging rows of one step (dsv4_kv_pool.raw_window_bytes).
Activations and graph pools are estimates (the largest tensors of one step), to be checked
against the measured numbers start-up logs (model_executor/memory_report.py).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, fields
from typing import Dict, Optional

import torch

from sglang.srt.layers.attention.dsv4.compressor import SPLIT_TERMS
from sglang.srt.layers.attention.dsv4.widths import (
    candidate_widths,
    indexer_bytes_per_candidate,
    indexer_chunk_tokens,
)
from sglang.srt.layers.quantization import QUANT_NUMERICS
from sglang.srt.mem_cache.dsv4_kv_pool import KV_CACHE_DTYPES  # what the pool can hold (auto: model dtype)
from sglang.srt.mem_cache.dsv4_kv_pool import kv_bytes_per_token as pool_kv_bytes_per_token
from sglang.srt.mem_cache.dsv4_kv_pool import raw_window_bytes
from sglang.srt.planning.meta_model import meta_tensors
from sglang.srt.planning.step_tokens import max_step_tokens

GiB = 1024**3
# An H200 has 141 GB of HBM; CUDA reports about 139.8 GiB total, of which about 139 GiB can
# hold tensors once the context and the allocator are up.
H200_USABLE_BYTES = 139 * GiB

WEIGHT_FORMATS = ("bfloat16", "float32", "release")

_ROUTED_EXPERT = re.compile(r"ffn\.experts\.w[123](_scale)?$")  # bf16 stacks, or FP4 bytes + scales


class MemoryPlanError(ValueError):
    """The model or the requested KV cache does not fit; the message names the flag to change."""


# ---- weights ------------------------------------------------------------------------------


@dataclass(frozen=True)
class WeightBytes:
    replicated: int  # held by every GPU (attention, shared experts, embeddings, MTP layer, ...)
    routed_experts: int  # every routed expert (MTP layers too); a GPU holds 1/ep of them

    def per_gpu(self, ep_size: int) -> int:
        return self.replicated + -(-self.routed_experts // ep_size)

    @property
    def total(self) -> int:
        return self.replicated + self.routed_experts


def loaded_weight_format(config, dtype: str) -> str:
    """The format weights take in memory once loaded: "release" when the checkpoint declares
    FP8 linears / FP4 experts (the model holds Fp8BlockLinear / Fp4RoutedExperts, which the
    loader and --load-format dummy fill without a dequantized copy), else the model dtype."""
    return "release" if config.is_quantized else dtype


def weight_bytes(config, weight_format: str, model_dtype: str = "bfloat16") -> WeightBytes:
    """Bytes of every parameter and buffer of the model as it is held in memory (the MTP
    modules the config lists too: a run's config lists only those speculation runs,
    ServerArgs.run_config), split into replicated and routed-expert parts (those of
    the MTP layers too: DP ranks build every layer's experts at their shard). "release": the
    config's quantized modules, the rest in model_dtype; "bfloat16" / "float32": every weight
    in that dtype (a release-format config dequantized)."""
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format must be one of {', '.join(WEIGHT_FORMATS)}, got {weight_format!r}")
    if weight_format != "release":
        model_dtype = weight_format
        config = dataclasses.replace(config, quantization_config=None, expert_dtype=None, extra=dict(config.extra))
    replicated = routed = 0
    for t in meta_tensors(config, model_dtype):
        if _ROUTED_EXPERT.search(t.name):
            routed += t.nbytes
        else:
            replicated += t.nbytes
    return WeightBytes(replicated, routed)


def load_transient_bytes(config, s: "PlanSettings") -> int:
    """Bytes held beside the weights only while they load: the humming MoE backend re-lays out
    one layer's routed experts at a time, and while humming writes gate/up's layout the stacked
    w1 | w3 it reads is still held (layers.moe.backends.humming_moe: one more copy of one
    layer's local gate/up experts, FP4 bytes + e8m0 scales). Nothing for other backends."""
    if s.moe_backend != "humming" or s.weight_format != "release" or not config.fp4_experts:
        return 0
    local = -(-config.n_routed_experts // s.dp_size)
    gate_up = 2 * config.moe_intermediate_size * config.hidden_size  # elements, w1 and w3
    return local * (gate_up // 2 + gate_up // 32)


def check_weights_fit(config, s: "PlanSettings", free_memory: int, weights: Optional[WeightBytes] = None) -> int:
    """The weights per GPU (and their tensor-core copies), after checking that they and what
    loading them holds for a while fit `free_memory`; MemoryPlanError names the flags otherwise."""
    w = weights if weights is not None else weight_bytes(config, s.weight_format, s.model_dtype)
    weights_gpu = w.per_gpu(s.dp_size) + tensor_core_copy_bytes(config, s.model_dtype)
    transient = load_transient_bytes(config, s)
    if weights_gpu + transient > free_memory:
        during = (f" plus {transient / GiB:.1f} GiB while the {s.moe_backend} MoE backend re-lays out one layer's "
                  f"experts" if transient else "")
        raise MemoryPlanError(
            f"weights need {weights_gpu / GiB:.1f} GiB per GPU at --dp-size {s.dp_size}{during}, "
            f"{free_memory / GiB:.1f} GiB is free: short by {(weights_gpu + transient - free_memory) / GiB:.1f} GiB; "
            f"raise --dp-size (routed experts are sharded across DP ranks) or run fewer layers with --num-layers")
    return weights_gpu


def estimate_weight_bytes(config, dtype_bytes: int) -> int:
    """Weight bytes of the model as it holds them in a model dtype of `dtype_bytes` (2: bf16,
    4: fp32): release-format weights at their quantized size (the loader keeps them so), the
    MTP modules the config lists and every routed expert included."""
    dtypes = {2: "bfloat16", 4: "float32"}
    if dtype_bytes not in dtypes:
        raise ValueError(f"dtype_bytes must be 2 (bfloat16) or 4 (float32), got {dtype_bytes!r}")
    dtype = dtypes[dtype_bytes]
    return weight_bytes(config, loaded_weight_format(config, dtype), dtype).total


def tensor_core_copy_bytes(config, model_dtype: str) -> int:
    """Bytes a bf16 model adds after load for its tensor-core GEMMs: every run layer's
    compressor wkv + wgate (c4 / c128 compressors and the c4 indexers') held as SPLIT_TERMS
    bf16 terms instead of fp32 (`Compressor.use_tensor_core_gemms` releases the fp32 weights
    when the terms hold them exactly): 2 bytes per element, the MTP modules' compressors too
    (the config lists only the modules a run builds: ServerArgs.run_config); an fp32 model
    adds nothing. dsv4-flash: 0.57 GiB per GPU."""
    if model_dtype != "bfloat16":
        return 0
    outputs = 0  # wkv's output width summed over compressors (wgate's is the same)
    for i in range(config.num_hidden_layers + config.num_mtp_layers):
        ratio = config.layer_compress_ratio(i)
        if ratio:
            outputs += (2 if ratio == 4 else 1) * config.head_dim
        if ratio == 4:
            outputs += 2 * config.index_head_dim
    return 2 * outputs * config.hidden_size * (SPLIT_TERMS * 2 - 4)


# ---- KV cache and per-request state -------------------------------------------------------


def _elt(dtype: str) -> int:
    return {"bfloat16": 2, "float16": 2, "float32": 4}[dtype]


def kv_bytes_per_token(config, kv_cache_dtype: str = "auto", model_dtype: str = "bfloat16",
                       index_keys_fp4: bool = False, mtp_layers: int = 0) -> int:
    """KV bytes one token of context costs across layers, whole bytes rounded up: DSV4KVPool's
    own count (mem_cache/dsv4_kv_pool.kv_bytes_per_token: 1/r of a compressed row on ratio-r
    layers, 1/4 of an indexer key on ratio-4 layers; FP8 rows in dsv4_kernels.kv_fp8's layout,
    584 B at head_dim 512 in bf16; indexer keys in the model dtype, or with index_keys_fp4
    (release numerics) packed FP4 rows, 68 B at index_head_dim 128); mtp_layers running MTP
    layers (speculative decoding) count like decoder layers. Raw KV is not per token:
    `raw_window_plan_bytes`."""
    return math.ceil(pool_kv_bytes_per_token(config, getattr(torch, model_dtype), kv_cache_dtype, index_keys_fp4,
                                             config.num_hidden_layers + mtp_layers))


def index_keys_fp4(s: "PlanSettings") -> bool:
    """Whether the pool packs the indexer keys as FP4: release-format weights run with release
    numerics (what the model runner gives DSV4KVPool)."""
    return s.weight_format == "release" and s.quant_numerics == "release"


def step_tokens(s: "PlanSettings") -> int:
    """The most tokens one step carries under these settings (planning/step_tokens.py): the
    pool's raw-KV staging rows."""
    return max_step_tokens(chunked_prefill_size=s.chunked_prefill_size, context_length=s.context_length,
                           max_running_requests=s.max_running_requests, breakable_max_tokens=s.breakable_max_tokens)


def raw_window_plan_bytes(config, s: "PlanSettings") -> int:
    """Raw KV under these settings: a window ring per request slot and one step's staging rows,
    every layer (DSV4KVPool's raw tensors, exactly); when speculating, the MTP layers' too, the
    residual streams every forward leaves for them (model.streams_out) and the MTP graphs'
    input copies of them (one per graph kind, its largest bucket's rows: mtp_graph_runner.py)."""
    dtype = getattr(torch, s.model_dtype)
    steps = step_tokens(s)
    raw = raw_window_bytes(config, dtype, s.kv_cache_dtype, s.max_running_requests, steps,
                           num_layers=config.num_hidden_layers + s.mtp_layers)
    stream_rows = steps + s.breakable_max_tokens + s.decode_graph_max_bs if s.mtp_layers else 0
    return raw + stream_rows * config.hc_mult * config.hidden_size * dtype.itemsize


def kv_rows_bytes(config, s: "PlanSettings", kv_tokens: int) -> int:
    """Exact bytes of the per-token KV rows (compressed entries and indexer keys) of the pool the
    model runner builds for `kv_tokens` tokens (a whole number of pages): kv_tokens plus the
    padding page at the pool's own per-token count (a page holds whole compressed rows, so the
    count is exact there)."""
    slots = kv_tokens + s.page_size
    per_token = pool_kv_bytes_per_token(config, getattr(torch, s.model_dtype), s.kv_cache_dtype, index_keys_fp4(s),
                                        config.num_hidden_layers + s.mtp_layers)
    return int(slots * per_token)


def kv_pool_bytes(config, s: "PlanSettings", kv_tokens: int) -> int:
    """DSV4KVPool.nbytes() of the pool the model runner builds for `kv_tokens` tokens: its
    per-token KV rows (kv_rows_bytes), its raw window rings and staging rows
    (raw_window_plan_bytes, which also counts the MTP layers' input streams when speculating),
    and per request row (max_running_requests + the padding request) the compressor rings and
    chained MTP modules' carried rows."""
    slot = compressor_ring_bytes(config, config.num_hidden_layers + s.mtp_layers) + \
        mtp_carry_bytes(config, s.mtp_layers, s.model_dtype)
    return kv_rows_bytes(config, s, kv_tokens) + raw_window_plan_bytes(config, s) + slot * (s.max_running_requests + 1)


def compressor_ring_bytes(config, num_layers: Optional[int] = None) -> int:
    """Per request slot, the compressor rings (fp32 kv + score, R = coff * ratio rows of
    coff * dim, for every compressed layer and c4 indexer), as DSV4KVPool allocates them, over
    the first num_layers layers (default: the decoder layers; MTP layers follow them)."""
    total = 0
    for layer in range(config.num_hidden_layers if num_layers is None else num_layers):
        r = config.layer_compress_ratio(layer)
        dims = [config.head_dim] + ([config.index_head_dim] if r == 4 else []) if r else []
        for dim in dims:
            coff = 2 if r == 4 else 1
            total += 2 * (coff * r) * (coff * dim) * 4
    return total


def mtp_carry_bytes(config, mtp_layers: int, model_dtype: str) -> int:
    """Per request slot, chained MTP modules' carried streams (DSV4KVPool.mtp_carry): one
    [hc, d] row in the model dtype per module after the first."""
    return max(0, mtp_layers - 1) * config.hc_mult * config.hidden_size * _elt(model_dtype)


def per_request_state_bytes(config, context_length: int, mtp_layers: int = 0, model_dtype: str = "bfloat16") -> int:
    """Per request slot: the compressor rings (the MTP layers' too), the chained MTP modules'
    carried streams and its page-table row (int32 per position), as DSV4KVPool and
    ReqToTokenPool allocate them."""
    return (compressor_ring_bytes(config, config.num_hidden_layers + mtp_layers)
            + mtp_carry_bytes(config, mtp_layers, model_dtype) + 4 * context_length)


def rope_table_bytes(config, context_length: int) -> int:
    # plain and YaRN tables, cos and sin, fp32, one row per position (models/deepseek_v4.py)
    return 2 * 2 * (context_length + 1) * (config.qk_rope_head_dim // 2) * 4


# ---- activations and graphs -----------------------------------------------------------------


def segment_activation_bytes(config, num_tokens: int, dp_size: int, num_reqs: int,
                             model_dtype: str = "bfloat16") -> int:
    """Peak transient bytes of the graph-segment part of one forward over `num_tokens` tokens on
    one rank: the larger of the MoE's working set (DP-gathered rows, fused_moe's per-pair
    buffers, the fp32 output) and the attention's (q, output, indexer q), plus the mHC residual
    streams and the logits of `num_reqs` rows. Nothing here depends on the context length. An
    estimate of the big tensors, not an allocator trace: start-up logs measured memory beside it."""
    e = _elt(model_dtype)
    T, d, H, hd = num_tokens, config.hidden_size, config.num_attention_heads, config.head_dim
    gathered = T * dp_size
    # the MoE kernels: gathered input, fp32 output (and the reduce-scatter's), and per (row,
    # top-k) pair the activation `h` [I] in the model dtype and the fp32 partial output [d]
    pairs = gathered * config.num_experts_per_tok
    inter = config.moe_intermediate_size
    moe = gathered * d * (e + 4 + 4) + pairs * (inter * e + d * 4)
    attn = T * H * hd * (2 * e + 4) + T * config.index_n_heads * (config.index_head_dim * e + 4)
    residual = 3 * T * config.hc_mult * d * 4  # X, the post-mix X', the mixed input (fp32)
    logits = num_reqs * config.vocab_size * 4 * 2
    return max(moe, attn) + residual + logits


def attention_break_bytes(config, num_tokens: int, max_seq_len: int) -> int:
    """Transient bytes of the attention break for `num_tokens` tokens of sequences up to
    `max_seq_len`: one bounded chunk of the indexer's top-k working set
    (layers/attention/dsv4/widths.py). The c4 / c128 candidates are read through the page
    table, so no per-token list counts here. Under breakable graphs this is eager, outside
    the graph pool; full decode graphs capture it. GPU plans: the Triton top-k."""
    c4_width, _ = candidate_widths(max_seq_len)
    chunk = min(num_tokens, indexer_chunk_tokens(config, c4_width, kernels=True))
    return chunk * c4_width * indexer_bytes_per_candidate(config, True)


# ---- the plan -------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes on one GPU. `kv_pool_tokens` is a whole number of pages."""

    free_memory: int  # measured free (or usable) memory before the model is loaded
    mem_fraction_static: float
    weights: int
    weights_replicated: int
    weights_routed_experts: int
    weights_tensor_core_copies: int  # derived after load (bf16 models): tensor_core_copy_bytes
    per_request_state: int  # compressor rings + page table, all request slots
    raw_window: int  # raw KV: every request slot's window rings + one step's staging rows
    rope_tables: int
    kv_bytes_per_token: int
    kv_pool_tokens: int
    kv_pool: int  # the KV rows, exactly: kv_pool_tokens plus the padding page (kv_rows_bytes)
    graph_pool: int
    activation_reserve: int
    headroom: int  # free memory left after all of the above

    def describe(self) -> str:
        g = lambda b: f"{b / GiB:.2f} GiB"  # noqa: E731
        return (f"weights {g(self.weights)} (replicated {g(self.weights_replicated)}, routed experts "
                f"{g(self.weights_routed_experts)}, tensor-core split weights (net) "
                f"{g(self.weights_tensor_core_copies)}), "
                f"KV pool {g(self.kv_pool)} ({self.kv_pool_tokens} tokens x "
                f"{self.kv_bytes_per_token} B), raw window KV {g(self.raw_window)}, request state "
                f"{g(self.per_request_state)}, rope tables "
                f"{g(self.rope_tables)}, graph pool {g(self.graph_pool)}, activation reserve "
                f"{g(self.activation_reserve)}, headroom {g(self.headroom)} of {g(self.free_memory)} free "
                f"(--mem-fraction-static {self.mem_fraction_static})")

    def as_dict(self) -> Dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True, kw_only=True)
class PlanSettings:
    """The serving settings a plan depends on. Fields named like ServerArgs fields are those
    settings, resolved, and have no defaults here: ServerArgs holds the only ones."""

    weight_format: str = "bfloat16"  # "bfloat16" | "float32" | "release" (loaded_weight_format)
    model_dtype: str = "bfloat16"  # activations and unquantized KV
    quant_numerics: str  # "release" | "weight_only"; release packs a release-format model's indexer keys
    kv_cache_dtype: str  # "auto" (model dtype) | "fp8_e4m3" | ...
    dp_size: int  # DP attention ranks; routed experts are sharded dp_size ways (EP = DP)
    page_size: int
    context_length: int
    max_running_requests: int
    chunked_prefill_size: int  # tokens per prefill step (no chunking: the context length)
    breakable_max_tokens: int = 0  # largest breakable-graph bucket; 0: breakable graphs off
    decode_graph_max_bs: int = 0  # largest decode-graph batch; 0: decode graphs off
    mtp_layers: int = 0  # MTP layers that run (speculative decoding): their caches and input streams
    moe_backend: str  # humming re-lays out a layer's experts while loading (load_transient_bytes)
    mem_fraction_static: float
    max_total_tokens: Optional[int]  # the user's KV size; None: what the fraction leaves

    def __post_init__(self):
        if self.quant_numerics not in QUANT_NUMERICS:
            raise ValueError(f"--quant-numerics must be one of {', '.join(QUANT_NUMERICS)}, got {self.quant_numerics!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if not 0 < self.mem_fraction_static <= 1:
            raise ValueError(f"--mem-fraction-static must be in (0, 1], got {self.mem_fraction_static}")


def plan_memory(config, s: PlanSettings, free_memory: int, weights: Optional[WeightBytes] = None) -> MemoryPlan:
    """Divide one GPU's `free_memory` (measured before loading; `H200_USABLE_BYTES` on paper).

    `free * mem_fraction_static` holds the weights, per-request state, rope tables and the KV
    pool; the other `free * (1 - mem_fraction_static)` must hold the graph pool and the
    activation reserve. Raises MemoryPlanError naming the shortfall and the flag to change.
    """
    w = weights if weights is not None else weight_bytes(config, s.weight_format, s.model_dtype)
    tensor_core_copies = tensor_core_copy_bytes(config, s.model_dtype)
    weights_gpu = check_weights_fit(config, s, free_memory, w)
    state = per_request_state_bytes(config, s.context_length, s.mtp_layers, s.model_dtype) * \
        (s.max_running_requests + 1)
    raw_window = raw_window_plan_bytes(config, s)
    rope = rope_table_bytes(config, s.context_length)
    per_token = kv_bytes_per_token(config, s.kv_cache_dtype, s.model_dtype, index_keys_fp4(s), s.mtp_layers)
    padding_page = s.page_size * per_token  # the pool's page 0, never handed out
    seg = lambda n, reqs: segment_activation_bytes(config, n, s.dp_size, reqs, s.model_dtype)  # noqa: E731
    # A graph pool is as large as its largest capture (buckets share it, captured largest first).
    # Breakable graphs hold segments only; decode graphs hold the attention break too.
    graph = (seg(s.breakable_max_tokens, s.max_running_requests) if s.breakable_max_tokens else 0) + (
        seg(s.decode_graph_max_bs, s.decode_graph_max_bs)
        + attention_break_bytes(config, s.decode_graph_max_bs, s.context_length) if s.decode_graph_max_bs else 0)
    # Eager steps and the eager breaks of replays: segments of the largest step (when not
    # replayed from the pool) and the break at the full context length.
    largest_step = max(s.chunked_prefill_size, s.breakable_max_tokens, 1)
    reserve = seg(largest_step, s.max_running_requests) + attention_break_bytes(config, largest_step, s.context_length)

    static_budget = int(free_memory * s.mem_fraction_static)
    fixed = weights_gpu + state + raw_window + rope
    min_kv = -(-s.context_length // s.page_size) * s.page_size  # one request of full context
    if fixed + padding_page + min_kv * per_token > static_budget:
        need = fixed + padding_page + min_kv * per_token
        # raising the fraction helps only while graphs and activations still fit beside it
        max_fraction = (free_memory - graph - reserve) / free_memory
        fix = (f"raise --mem-fraction-static (to {need / free_memory:.3f}), " if need / free_memory <= max_fraction
               else "")
        raise MemoryPlanError(
            f"not enough memory for the KV cache: --mem-fraction-static {s.mem_fraction_static} gives "
            f"{static_budget / GiB:.1f} GiB for weights + KV, which need {need / GiB:.1f} GiB (weights "
            f"{weights_gpu / GiB:.1f}, request state {state / GiB:.1f} and raw window KV {raw_window / GiB:.1f} for "
            f"--max-running-requests {s.max_running_requests}, KV for one --context-length {s.context_length} request "
            f"{min_kv * per_token / GiB:.1f}): short by {(need - static_budget) / GiB:.1f} GiB; {fix}lower "
            f"--context-length or --max-running-requests, or raise --dp-size")
    if per_token:
        kv_tokens = (static_budget - fixed - padding_page) // per_token // s.page_size * s.page_size
    else:  # only window layers (their rows live in per-request rings): nothing grows with the tokens
        kv_tokens = s.context_length * s.max_running_requests
    if s.max_total_tokens is not None:
        if s.max_total_tokens > kv_tokens:
            raise MemoryPlanError(
                f"--max-total-tokens {s.max_total_tokens} needs {s.max_total_tokens * per_token / GiB:.1f} GiB of KV, "
                f"{(static_budget - fixed - padding_page) / GiB:.1f} GiB is left: short by "
                f"{(s.max_total_tokens - kv_tokens) * per_token / GiB:.1f} GiB; lower --max-total-tokens "
                f"or raise --mem-fraction-static")
        kv_tokens = s.max_total_tokens // s.page_size * s.page_size
    kv_tokens = min(kv_tokens, s.context_length * s.max_running_requests)  # never more than can be used
    kv_tokens = max(kv_tokens, min_kv)
    dynamic_budget = free_memory - static_budget
    if graph + reserve > dynamic_budget:
        short = graph + reserve - dynamic_budget
        fraction = (free_memory - graph - reserve) / free_memory
        raise MemoryPlanError(
            f"graph pool {graph / GiB:.1f} GiB + activation reserve {reserve / GiB:.1f} GiB need more than the "
            f"{dynamic_budget / GiB:.1f} GiB --mem-fraction-static {s.mem_fraction_static} leaves: short by "
            f"{short / GiB:.1f} GiB; lower --mem-fraction-static (to {fraction:.3f} at most), or "
            f"--breakable-cuda-graph-max-tokens / --chunked-prefill-size / --cuda-graph-max-bs")
    kv = kv_rows_bytes(config, s, kv_tokens)
    return MemoryPlan(
        free_memory=free_memory, mem_fraction_static=s.mem_fraction_static, weights=weights_gpu,
        weights_replicated=w.replicated, weights_routed_experts=weights_gpu - tensor_core_copies - w.replicated,
        weights_tensor_core_copies=tensor_core_copies,
        per_request_state=state, raw_window=raw_window, rope_tables=rope, kv_bytes_per_token=per_token, kv_pool_tokens=kv_tokens,
        kv_pool=kv, graph_pool=graph, activation_reserve=reserve,
        headroom=free_memory - fixed - kv - graph - reserve,
    )


def min_gpus_to_fit(config, s: PlanSettings, gpu_memory: int = H200_USABLE_BYTES,
                    candidates=(1, 2, 4, 8, 16, 32)) -> int:
    """The fewest GPUs (DP ranks, experts sharded across them) on which `plan_memory` fits."""
    w = weight_bytes(config, s.weight_format, s.model_dtype)
    for n in candidates:
        if config.n_routed_experts % n:
            continue
        try:
            plan_memory(config, dataclasses.replace(s, dp_size=n), gpu_memory, w)
            return n
        except MemoryPlanError:
            continue
    raise MemoryPlanError(f"does not fit on {max(candidates)} GPUs of {gpu_memory / GiB:.0f} GiB")
