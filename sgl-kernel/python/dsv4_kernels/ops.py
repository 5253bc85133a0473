"""Public DSV4 kernel entry points: Triton on CUDA tensors (when triton imports), the plain-torch
reference otherwise. Kernel modules are imported on first use so this package never needs triton.

All functions are CUDA-graph capturable on the Triton path: no host syncs, static shapes, and
results written into the caller's buffers where an `out`-style argument is given.
"""

import functools
import importlib

import torch

from . import quant_reference, reference


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    try:
        importlib.import_module("triton")
        return True
    except Exception:  # an absent or broken install both mean "use the reference"
        return False


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and triton_available()


@functools.lru_cache(maxsize=None)
def _kernels(name: str):
    return importlib.import_module(f"{__package__}.{name}")  # cached: called on every step


def sparse_attn_with_sink(q, kv_a, idx_a, len_a, kv_b, idx_b, len_b, sink, scale, out,
                          kv_layout=None, out_rope=None, keep_rows=None):
    """out [T, H, D] = sink-softmax attention of q [T, H, D] over the valid rows of kv_a (idx_a
    [T, Wa], first len_a entries, -1 skipped) and of kv_b (may be None). Either list may be a
    PageTableList (entries read from the page table, the c128 case). With kv_layout
    (kv_fp8.FP8KVLayout) both pools hold FP8 KV rows, dequantized on load. out_rope (cos, sin,
    positions, rope_dim): out leaves with that RoPE undone, as inverse_rope_ would. keep_rows
    (staging_start, keep_loc): keep_window_rows_ on kv_a too, in the same launch on CUDA; only
    when no list reads a ring row being written (one token per request). Returns out."""
    impl = _kernels("sparse_attention") if _use_triton(q) else reference
    return impl.sparse_attn_with_sink(q, kv_a, idx_a, len_a, kv_b, idx_b, len_b, sink, scale, out,
                                      kv_layout=kv_layout, out_rope=out_rope, keep_rows=keep_rows)


def rmsnorm_rope_store(kv, norm_weight, eps, cos, sin, positions, rope_dim, pool, out_loc,
                       kv_out=None, nope_fp8=False):
    """RMSNorm(kv [T, D]) * weight -> RoPE on the last rope_dim dims -> pool[out_loc[t]]
    (skipped where out_loc == -1; pool None: not stored) and kv_out [T, D] (unrounded) if
    given. Returns kv_out.
    nope_fp8: the nope dims are FP8-rounded per 64 before a float pool stores them; a uint8
    pool holds FP8 KV rows (kv_fp8.py) and always quantizes."""
    impl = _kernels("cache_write") if _use_triton(kv) else reference
    return impl.rmsnorm_rope_store(kv, norm_weight, eps, cos, sin, positions, rope_dim, pool,
                                   out_loc, kv_out, nope_fp8=nope_fp8)


def q_rms_rope(q, cos, sin, positions, rope_dim, eps):
    """In place on q [T, H, D]: weight-free per-head RMS normalisation, then RoPE."""
    impl = _kernels("cache_write") if _use_triton(q) else reference
    return impl.q_rms_rope(q, cos, sin, positions, rope_dim, eps)


def q_kv_norm_rope_store(q, kv, norm_weight, eps, cos, sin, positions, rope_dim, pool, out_loc, nope_fp8=False):
    """q_rms_rope(q, ...) and rmsnorm_rope_store(kv, ..., pool, out_loc) of one layer in one
    launch on CUDA (the same values as the two). Returns q."""
    impl = _kernels("cache_write") if _use_triton(q) else reference
    return impl.q_kv_norm_rope_store(q, kv, norm_weight, eps, cos, sin, positions, rope_dim, pool, out_loc,
                                     nope_fp8=nope_fp8)


def inverse_rope_(o, cos, sin, positions, rope_dim):
    """In place on o [T, H, D]: RoPE by -angle on the last rope_dim dims."""
    impl = _kernels("cache_write") if _use_triton(o) else reference
    return impl.inverse_rope_(o, cos, sin, positions, rope_dim)


def compressor_pool(kv_state, score_state, kv_new, score_new, gather_idx, ratio, out, ape=None, positions=None,
                    ring_write_loc=None):
    """out [E, D] fp32: per-channel softmax pooling of each emission's rows (see reference).
    ape [ratio, C] fp32 with positions [T]: the fresh scores get their position's ape row as
    they are read (the model's `score + ape[p % ratio]`, without a launch of its own).
    ring_write_loc: then compressor_state_update of this step's tokens (rows unique), in the
    same launch on CUDA; only when no emission reads a ring row the step writes (a decode step)."""
    if _use_triton(out):
        return _kernels("compressor").compressor_pool(kv_state, score_state, kv_new, score_new, gather_idx, ratio,
                                                      out, ape, positions, ring_write_loc)
    reference.compressor_pool(kv_state, score_state, kv_new, score_new, gather_idx, ratio, out, ape, positions)
    if ring_write_loc is not None:
        reference.compressor_state_update(kv_state, score_state, kv_new, score_new, ring_write_loc, True, ape,
                                          positions)
    return out


def compressor_emit(kv_state, score_state, kv_new, score_new, gather_idx, ratio, pooled, norm_weight, eps, cos, sin,
                    emit_pos, rope_dim, pool, out_loc, entries=None, nope_fp8=False, ape=None, positions=None,
                    ring_write_loc=None):
    """A compressor's emissions in one launch on CUDA: compressor_pool into `pooled` (fp32
    [E, D]), then rmsnorm_rope_store of those rows (into pool at out_loc, or into `entries`
    unrounded), and with ring_write_loc compressor_state_update of this step's tokens (rows
    unique). Give ring_write_loc only when no emission reads a ring row the step writes: every
    request feeds one token (a decode step). Elsewhere the three reference steps in order."""
    if _use_triton(pooled):
        _kernels("compressor").compressor_emit(kv_state, score_state, kv_new, score_new, gather_idx, ratio, pooled,
                                               norm_weight, eps, cos, sin, emit_pos, rope_dim, pool, out_loc, entries,
                                               nope_fp8, ape, positions, ring_write_loc)
        return
    reference.compressor_pool(kv_state, score_state, kv_new, score_new, gather_idx, ratio, pooled, ape, positions)
    if ring_write_loc is not None:
        reference.compressor_state_update(kv_state, score_state, kv_new, score_new, ring_write_loc, True, ape,
                                          positions)
    reference.rmsnorm_rope_store(pooled, norm_weight, eps, cos, sin, emit_pos, rope_dim, pool, out_loc,
                                 kv_out=entries, nope_fp8=nope_fp8)


def compressor_norm_rope_store(pooled, norm_weight, eps, cos, sin, emit_pos, rope_dim, pool,
                               emit_out_loc):
    impl = _kernels("compressor") if _use_triton(pooled) else reference
    impl.compressor_norm_rope_store(pooled, norm_weight, eps, cos, sin, emit_pos, rope_dim, pool,
                                    emit_out_loc)


def compressor_state_update(kv_state, score_state, kv_new, score_new, ring_write_loc, rows_unique=False,
                            ape=None, positions=None):
    """Ring rows ring_write_loc[t] (flat req_slot * R + p % R, -1 skip) <- token t's fresh
    kv/score; when several tokens hit one row the last token wins. rows_unique: the caller
    guarantees no two tokens share a row (token_metadata's ring locs: only a request's last R
    positions write), so the winners need not be found (on CUDA: one launch instead of a
    dozen). ape / positions: as compressor_pool's; the ring stores the score with it added."""
    impl = _kernels("compressor") if _use_triton(kv_state) else reference
    impl.compressor_state_update(kv_state, score_state, kv_new, score_new, ring_write_loc, rows_unique, ape,
                                 positions)


def indexer_topk(q_idx, weights, key_pool, cand_slots, cand_len, topk, out_slots):
    """out_slots [T, topk] int32: cand_slots of the best min(topk, cand_len) indexer scores in
    no particular order, -1 for the rest. cand_slots: [T, C] slots or a PageTableList of width
    C (the runtime's: candidates read from the page table). key_pool: float keys in q_idx's
    dtype, or uint8 packed FP4 keys (index_key_fp4.py), unpacked as they are read. Returns out_slots."""
    impl = _kernels("indexer") if _use_triton(q_idx) else reference
    return impl.indexer_topk(q_idx, weights, key_pool, cand_slots, cand_len, topk, out_slots)


def moe_route(router_logits, bias, topk, scaling, tid2eid=None, input_ids=None, ids_dtype=torch.int32):
    """(weights [T, topk] fp32, ids [T, topk] ids_dtype) from sqrt-softplus router logits (see
    reference.moe_route). On CUDA one Triton launch (router.py) instead of torch's dozen."""
    impl = _kernels("router") if _use_triton(router_logits) else reference
    return impl.moe_route(router_logits, bias, topk, scaling, tid2eid, input_ids, ids_dtype)


def local_expert_ids(ids, first_expert: int, drop_repeats: bool):
    """Routing ids [T, k] -> this rank's local expert ids, repeats dropped on request
    (reference.local_expert_ids); one launch on CUDA."""
    impl = _kernels("moe") if _use_triton(ids) else reference
    return impl.local_expert_ids(ids, first_expert, drop_repeats)


def fused_moe(x, w1, w3, w2, ids, weights, swiglu_limit, out):
    """out [T, d] = sum_k weights[t,k] * W2_e(silu(min(W1_e x, L)) * clamp(W3_e x, -L, L))."""
    impl = _kernels("moe") if _use_triton(x) else reference
    return impl.fused_moe(x, w1, w3, w2, ids, weights, swiglu_limit, out)


def token_metadata(req_slot, positions, seq_len, valid, prefix, chunk_start, padding_slot, staging_start, topk,
                   out):
    """Every per-token metadata field of a step in one launch on CUDA (see reference)."""
    impl = _kernels("metadata") if _use_triton(positions) else reference
    return impl.token_metadata(req_slot, positions, seq_len, valid, prefix, chunk_start, padding_slot, staging_start,
                               topk, out)


def emission_metadata(rtt, req_slot, positions, valid, prefix, chunk_start, rows, num_real,
                      padding_slot, ratio, gather_idx, out_loc, emit_pos):
    """A ratio's compressor emissions in one launch on CUDA (see reference)."""
    impl = _kernels("metadata") if _use_triton(positions) else reference
    impl.emission_metadata(rtt, req_slot, positions, valid, prefix, chunk_start, rows, num_real,
                           padding_slot, ratio, gather_idx, out_loc, emit_pos)


def step_metadata(rtt, req_slot, positions, seq_len, valid, prefix, chunk_start, padding_slot, staging_start, topk,
                  out, emissions):
    """A step's token metadata and every ratio's emissions (see reference) in one launch on CUDA."""
    impl = _kernels("metadata") if _use_triton(positions) else reference
    return impl.step_metadata(rtt, req_slot, positions, seq_len, valid, prefix, chunk_start, padding_slot,
                              staging_start, topk, out, emissions)


def keep_window_rows_(raw, staging_start, keep_loc):
    """raw[keep_loc[t]] = raw[staging_start + t] for every t < keep_loc.numel(): each
    request's last W new raw rows move from the step's staging rows into its ring, after the
    attention has read every window (keep_loc: token_metadata's raw_keep_loc). One launch on
    CUDA; capturable (decode graphs capture it with the attention core)."""
    if _use_triton(raw):
        return _kernels("window_ring").keep_window_rows_(raw, staging_start, keep_loc)
    return reference.keep_window_rows_(raw, staging_start, keep_loc)


# Per-token compressor plan (one pooled row per token; the kernel tests' metadata source):
# vectorised torch, no per-request loop, no host sync, identical on CPU and CUDA.
compressor_plan = reference.compressor_plan


def hc_pre(x, fn, scale, base, hc, iters, hc_eps, norm_eps, y_out=None, rms_weight=None, rms_eps=0.0):
    """mHC input mixing of x [T, hc, d] in two launches (mhc.py: a split-K mixes GEMM, then the
    per-token gates, Sinkhorn and gated sum): (y [T, d] in x.dtype, written into
    y_out if given; post [T, hc] fp32; comb [T, hc, hc] fp32, Sinkhorn-projected).
    rms_weight [d]: the sub-layer's RMSNorm follows (rms_norm's formula), inside the second
    launch on CUDA, and the first result is the normed y."""
    if _use_triton(x):
        return _kernels("mhc").hc_pre(x, fn, scale, base, hc, iters, hc_eps, norm_eps, y_out, rms_weight, rms_eps)
    y, post, comb = reference.hc_pre(x, fn, scale, base, hc, iters, hc_eps, norm_eps)
    if rms_weight is not None:
        y = rms_norm(y, rms_weight, rms_eps)
    if y_out is not None:
        y = y_out.copy_(y)
    return y, post, comb


def hc_post(f, residual, post, comb, out=None):
    """mHC write-back in one launch: out [T, hc, d] = post_j * f + sum_i comb[i, j] * X_i
    (residual.dtype; out may be residual itself). Returns out."""
    impl = _kernels("mhc") if _use_triton(residual) else reference
    return impl.hc_post(f, residual, post, comb, out)


def indexer_rope_rotate_round_(x, cos, sin, positions, rope_dim, rotate=True):
    """In place on the indexer's rows x [T, H, D] (or [T, D]): RoPE on the last rope_dim dims
    (tables [max_pos, rope_dim/2] at positions [T]; rope_dim 0: none), then with `rotate`
    the Walsh-Hadamard rotation and the FP4 rounding per 32 (release numerics). Returns x."""
    if _use_triton(x):
        return _kernels("indexer_rotate").rope_rotate_round_(x, cos, sin, positions, rope_dim, rotate)
    if rope_dim:
        x.copy_(reference.apply_rope(x, cos, sin, positions, rope_dim))
    if rotate:
        x.copy_(quant_reference.fp4_round_blocks(quant_reference.hadamard_rotate(x)))
    return x


def store_index_keys_fp4(keys, key_pool, out_loc):
    """key_pool[out_loc[e]] <- the indexer's emitted keys [E, D] Hadamard-rotated, FP4-rounded
    per 32 and packed (uint8 rows of index_key_fp4.py); out_loc -1 skipped. Release numerics'
    key write for a packed key pool, one launch on CUDA. Returns key_pool."""
    if _use_triton(keys):
        return _kernels("indexer_rotate").rotate_round_pack_store(keys, key_pool, out_loc)
    return reference.store_index_keys_fp4(keys, key_pool, out_loc)


def rms_norm(x, weight, eps):
    """weight * x * rsqrt(mean(x^2) + eps) over x's last dim, fp32 math, in x's dtype (weight
    may be None: no scale). One launch instead of torch's eight fp32 passes."""
    if _use_triton(x):
        return _kernels("elementwise").rms_norm(x, weight, eps)
    return reference.rms_norm(x, weight, eps).to(x.dtype)


def swiglu_clamped(gate, up, limit, out_dtype):
    """The shared expert's silu(min(gate, limit)) * clamp(up, +-limit), fp32 math, rounded
    once to out_dtype (gate, up [T, n]; limit <= 0: no clamp)."""
    if _use_triton(gate):
        return _kernels("elementwise").swiglu_clamped(gate, up, limit, out_dtype)
    return reference.swiglu_clamped(gate.float(), up.float(), limit).to(out_dtype)


def add_fp32(a, b, out_dtype):
    """(a + b) in fp32, rounded once to out_dtype (a, b [T, n]): the MoE's routed + shared sum."""
    if _use_triton(a):
        return _kernels("elementwise").add_fp32(a, b, out_dtype)
    return (a.float() + b.float()).to(out_dtype)


# ----------------------------------------------------------------------------------------
# Release weight format: FP8 block-scaled linears, FP4 routed experts (quant_reference.py
# holds the formulas; these are the entry points the model calls)
# ----------------------------------------------------------------------------------------
quantize_fp8_blocks = quant_reference.quantize_fp8_blocks
fp8_round_blocks = quant_reference.fp8_round_blocks
fp4_round_blocks = quant_reference.fp4_round_blocks
hadamard_rotate = quant_reference.hadamard_rotate


def fp8_block_linear(x, weight, weight_scale, act_quant: bool, backend: str = "auto",
                     cublas_scale=None):
    """x [..., K] @ dequant(weight e4m3 [N, K], weight_scale fp32 [ceil(N/128), ceil(K/128)])^T
    -> x.dtype [..., N]; act_quant: x quantized per 128 along K first (release numerics).
    On CUDA, backend "auto" / "triton" / "cublas" picks the GEMM (fp8_gemm.fp8_block_linear;
    cublas_scale: the scales in cuBLAS's layout, built once by the caller); elsewhere the
    reference runs and "cublas" is refused."""
    if _use_triton(x):
        return _kernels("fp8_gemm").fp8_block_linear(x, weight, weight_scale, act_quant,
                                                     backend=backend, cublas_scale=cublas_scale)
    if backend != "auto" and backend != "triton":
        raise ValueError(f"fp8_block_linear: backend={backend!r} needs CUDA tensors and triton "
                         f"(x is on {x.device.type}); 'auto' or 'triton' run the reference here")
    return quant_reference.fp8_block_linear_ref(x, weight, weight_scale, act_quant)


def bf16_gemv_takes(x, weight) -> bool:
    """Whether bf16_gemv runs its one-row kernel for x and weight (CUDA, bf16, a row-major
    weight of whole repeats of K): callers keep their tensor-core GEMM otherwise."""
    K = x.shape[-1]
    return (_use_triton(x) and x.dtype == weight.dtype == torch.bfloat16 and weight.stride(-1) == 1
            and K > 0 and _kernels("bf16_gemv").fits(x.numel() // K, K, weight.shape[1]))


def bf16_gemv(x, weight, scale: float = 1.0, round_bf16: bool = False):
    """x [..., K] bf16 @ weight bf16 [N, R * K]^T, x repeated R times along K (a split fp32
    weight's terms, tensor_core_gemm.split_weight) -> fp32 [..., N]: exact products, fp32
    sums; round_bf16 rounds them to bf16 (a bf16 linear's output); then times scale. One
    launch for a row on CUDA (bf16_gemv.py; see bf16_gemv_takes), the reference elsewhere."""
    impl = _kernels("bf16_gemv") if _use_triton(x) else reference
    return impl.bf16_gemv(x, weight, scale, round_bf16)


def fp8_block_linear_pair(x, a, b):
    """(a(x), b(x)) for two Fp8BlockLinear-like modules (weight, weight_scale, act_quant,
    cublas_scale()) of one shape: on CUDA a single row takes one GEMV launch for both
    (fp8_gemv.fp8_gemv_pair, the shared expert's gate and up); otherwise each its own linear."""
    if _use_triton(x):
        return _kernels("fp8_gemm").fp8_block_linear_pair(x, a, b)
    return a(x), b(x)


def fp8_swiglu_linear_add(gate, up, linear, limit: float, add, streams=None):
    """(add + linear(swiglu_clamped(gate, up, limit, gate.dtype))) in fp32, rounded to gate.dtype
    (gate, up [T, K]; linear an Fp8BlockLinear-like module; add fp32 [T, N]): the shared
    expert's down projection between its activation and the MoE's routed + shared sum. streams
    (residual, post, comb): hc_post of that instead. On CUDA a single row is one GEMV launch for
    all of it (fp8_gemv.fp8_gemv_swiglu_add)."""
    if _use_triton(gate):
        return _kernels("fp8_gemm").fp8_swiglu_linear_add(gate, up, linear, limit, add, streams)
    act = reference.swiglu_clamped(gate.float(), up.float(), limit).to(gate.dtype)
    y = (add.float() + linear(act).float()).to(gate.dtype)
    return y if streams is None else reference.hc_post(y, *streams)


def rms_linear_fuses(x, linear) -> bool:
    """Whether fp8_rms_linear takes one launch here (CUDA, one row, an FP8 block linear)."""
    return _use_triton(x) and _kernels("fp8_gemm").takes_one_row_gemv(x, linear)


def stack_fuses(x, stack) -> bool:
    """Whether linears stacked on x (an Fp8RowStack) run as one GEMM here: CUDA, 1..64 rows
    (the one-row GEMV or the Triton small-M GEMM; larger batches take each linear alone)."""
    return _use_triton(x) and _kernels("fp8_gemm").takes_small_m(x, stack)


def fp8_rms_linear(x, norm_weight, eps: float, linear):
    """linear(rms_norm(x, norm_weight, eps)): on CUDA a single row into an FP8 block linear is
    one GEMV launch with the norm in its prologue (fp8_gemv's RMS step)."""
    if _use_triton(x):
        return _kernels("fp8_gemm").fp8_rms_linear(x, norm_weight, eps, linear)
    return linear(rms_norm(x, norm_weight, eps))


def fp8_linear_hc_post(x, linear, residual, post, comb):
    """hc_post(linear(x), residual, post, comb) (linear an Fp8BlockLinear-like module): a
    sub-layer's last linear and the mHC post step; on CUDA one GEMV launch for a single row."""
    if _use_triton(x):
        return _kernels("fp8_gemm").fp8_linear_hc_post(x, linear, residual, post, comb)
    return reference.hc_post(linear(x), residual, post, comb)


def dequantize_fp8_block(weight, scale, dtype=torch.float32):
    """An FP8 block-scaled weight e4m3 [N, K] dequantized to `dtype` (fp32, or bf16: exact
    while the scales are powers of two): quant_reference.dequantize_fp8_block, one launch on
    CUDA."""
    if _use_triton(weight):
        return _kernels("fp8_gemm").dequantize_weight(weight, scale, dtype)
    return quant_reference.dequantize_fp8_block(weight, scale, dtype)


def fp8_grouped_linear(x, weight, weight_scale):
    """Block-diagonal weight-only FP8: x [T, G, K] -> x.dtype [T, G, n], group g through weight
    rows [g n, (g + 1) n) (wo_a's grouped einsum at decode sizes). On CUDA one launch of the
    Triton weight-only GEMM (fp8_gemm.fp8_grouped_linear); elsewhere the reference per group."""
    if _use_triton(x):
        return _kernels("fp8_gemm").fp8_grouped_linear(x, weight, weight_scale)
    G = x.shape[1]
    n = weight.shape[0] // G
    if n * G != weight.shape[0] or n % 128:
        raise ValueError(f"fp8_grouped_linear: {weight.shape[0]} weight rows over {G} groups must be "
                         "whole 128-row blocks per group")
    return torch.stack([quant_reference.fp8_block_linear_ref(
        x[:, g], weight[g * n:(g + 1) * n], weight_scale[g * n // 128:(g + 1) * n // 128], False)
        for g in range(G)], dim=1)


def fp4_fused_moe(x, w1, w1_scale, w3, w3_scale, w2, w2_scale, ids, weights, limit, out,
                  act_quant: bool):
    """out fp32 [T, d] <- the FP4 routed experts' sum (quant_reference.fp4_moe_ref's contract:
    packed e2m1 int8 [E, out, in/2] + e8m0 uint8 scales [E, out, in/32]; ids outside [0, E)
    skipped; weight applied before W2). Returns out."""
    if _use_triton(x):
        return _kernels("fp4_moe").fp4_fused_moe(x, w1, w1_scale, w3, w3_scale, w2, w2_scale,
                                                 ids, weights, limit, out, act_quant)
    out.copy_(quant_reference.fp4_moe_ref(x, w1, w1_scale, w3, w3_scale, w2, w2_scale, ids,
                                           weights, limit, act_quant))
    return out
