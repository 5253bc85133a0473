"""The "gemv" variant of fp4_moe.fp4_fused_moe, for decode-sized batches (a few assignments
per expert), no MMA: each program owns BLOCK_M (1, 2 or 4) rows of one expert and BLOCK_N
weight rows, and walks K in steps
of CHUNKS x 32 inputs, 8 KB of weights per program and step (gemv_config: while few
experts are hit, 16-32 rows x 512 inputs = 256 contiguous packed bytes per row, so even the
6 experts of one token give hundreds of programs with tens of KB in flight per SM; beyond,
64 rows x 128 inputs: fewer programs of a grid that is mostly empty padding blocks), the
next step's bytes loaded before this step's math, as int32 words. Codes are
decoded once per step to exact fp32 values x 2^-14, two per shift-and-merge (codes i and
i + 4 of a word sit 16 bits apart, as the halves of an fp16 pair: built as fp16 bits, each
half converted; ~3.5 integer instructions per code in an sm_90 compile, against ~9 for
_e2m1_scaled's compares and selects), and shared by the block's rows: per row one FMA per
weight and an in-thread sum per 32-input chunk, the chunk sum times the chunk's weight
scale (a power of two: exact) added to a [BLOCK_N, CHUNKS] fp32 accumulator reduced (and
x 2^14) once at the end. A 1-2 row expert block costs 1-2 FMAs per weight element instead
of a 16-row MMA tile. Activations (x, and h before the down GEMM) are rounded to FP8 per
128 by the host kernels and read in x's dtype (e4m3 x a pow2 scale is exact there), so
products are exact e2m1 x e4m3 values in fp32 as in the release; without act_quant, x and
h as they are. Same alignment (moe_align at BLOCK_M), h layout, partials and top-k sum as
the other variants.
N is split finely at small batches; K is not split (a split would need a second fp32
reduction pass; at Flash's dims T = 1 already gives hundreds of programs).

Graph-safe as the other variants: buffers sized by (T, topk, E), tiles fixed per shape.
"""

import torch
import triton
import triton.language as tl

from .fp4_words import TL_DTYPE, chunks, decode_words, load_words
from .fp8_act_quant import round_act
from .host_math import cdiv
from .moe import moe_align, sum_topk
from .tile_tables import CONFIGS, load_tiers, pick

TILES_FILE = CONFIGS / "fp4_gemv_moe_tiles.json"
_TIERS = load_tiers(TILES_FILE)


@triton.jit
def _gemv_row(acc, acc3, w, s, w3, s3, a_ptr, a_row, k0, stride_a, PAIR: tl.constexpr,
              CHUNKS: tl.constexpr):
    """acc [BN, CHUNKS] += (chunk sums of w x this row's inputs) x s, and with PAIR acc3 the
    same with w3/s3 (one activation load for both). Unmasked (vector loads): the callers point
    a padding row at a real row of A, and its sums are never stored."""
    kk = k0 + tl.arange(0, CHUNKS)[:, None] * 32 + tl.arange(0, 32)[None, :]
    a = tl.load(a_ptr + a_row * stride_a + kk).to(tl.float32)
    acc += tl.sum(w * a[None, :, :], axis=2) * s
    if PAIR:
        acc3 += tl.sum(w3 * a[None, :, :], axis=2) * s3
    return acc, acc3


@triton.jit
def _gemv_rows(a_ptr, a_rows, stride_a, w_ptr, s_ptr, w3_ptr, s3_ptr, e, offs_n, n_mask, K,
               stride_we, stride_wn, stride_se, stride_sn, PAIR: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr):
    """[BLOCK_N] fp32 dots of rows a_rows[m] (m < BLOCK_M <= 4; each a row A holds, padding
    rows too) of A with W_e's rows n (and with PAIR W3_e's), K = CHUNKS * 32 per step. Returns
    (g0, g1, g2, g3, u0, u1, u2, u3): g for W, u for W3; rows past BLOCK_M stay 0. One
    accumulator per row (not a [BLOCK_M, ...] tensor) keeps every row's update in the weights'
    register layout: a row-select would move data between threads every step."""
    r0 = _pick(a_rows, 0)
    r1 = _pick(a_rows, 1)
    r2 = _pick(a_rows, 2)
    r3 = _pick(a_rows, 3)
    g0 = tl.zeros([BLOCK_N, CHUNKS], tl.float32)
    g1 = tl.zeros([BLOCK_N, CHUNKS], tl.float32)
    g2 = tl.zeros([BLOCK_N, CHUNKS], tl.float32)
    g3 = tl.zeros([BLOCK_N, CHUNKS], tl.float32)
    u0 = tl.zeros([BLOCK_N, CHUNKS], tl.float32)
    u1 = tl.zeros([BLOCK_N, CHUNKS], tl.float32)
    u2 = tl.zeros([BLOCK_N, CHUNKS], tl.float32)
    u3 = tl.zeros([BLOCK_N, CHUNKS], tl.float32)
    # The next step's raw bytes are loaded before this step's decode and FMAs (a prefetch by
    # hand: these loads feed no tl.dot, so the pipeliner leaves them alone), doubling the bytes
    # in flight for 4-8 registers; the last step reloads itself rather than masking.
    STEP: tl.constexpr = 32 * CHUNKS
    nb, ns = load_words(w_ptr, s_ptr, e, offs_n, n_mask, 0, stride_we, stride_wn, stride_se,
                         stride_sn, CHUNKS)
    nb3, ns3 = nb, ns
    if PAIR:
        nb3, ns3 = load_words(w3_ptr, s3_ptr, e, offs_n, n_mask, 0, stride_we, stride_wn,
                               stride_se, stride_sn, CHUNKS)
    for k0 in range(0, K, STEP):
        k_next = tl.minimum(k0 + STEP, K - STEP)
        cb, cs, cb3, cs3 = nb, ns, nb3, ns3
        nb, ns = load_words(w_ptr, s_ptr, e, offs_n, n_mask, k_next, stride_we, stride_wn,
                             stride_se, stride_sn, CHUNKS)
        if PAIR:
            nb3, ns3 = load_words(w3_ptr, s3_ptr, e, offs_n, n_mask, k_next, stride_we,
                                   stride_wn, stride_se, stride_sn, CHUNKS)
        w, s = decode_words(cb, cs)
        w3, s3 = w, s
        if PAIR:
            w3, s3 = decode_words(cb3, cs3)
        g0, u0 = _gemv_row(g0, u0, w, s, w3, s3, a_ptr, r0, k0, stride_a, PAIR, CHUNKS)
        if BLOCK_M > 1:
            g1, u1 = _gemv_row(g1, u1, w, s, w3, s3, a_ptr, r1, k0, stride_a, PAIR, CHUNKS)
        if BLOCK_M > 2:
            g2, u2 = _gemv_row(g2, u2, w, s, w3, s3, a_ptr, r2, k0, stride_a, PAIR, CHUNKS)
            g3, u3 = _gemv_row(g3, u3, w, s, w3, s3, a_ptr, r3, k0, stride_a, PAIR, CHUNKS)
    # The weights were decoded x 2^-14 (fp4_words.nibbles_x2m14): undo it once per output (exact).
    return (tl.sum(g0, axis=1) * 16384.0, tl.sum(g1, axis=1) * 16384.0,
            tl.sum(g2, axis=1) * 16384.0, tl.sum(g3, axis=1) * 16384.0,
            tl.sum(u0, axis=1) * 16384.0, tl.sum(u1, axis=1) * 16384.0,
            tl.sum(u2, axis=1) * 16384.0, tl.sum(u3, axis=1) * 16384.0)


@triton.jit
def _gemv_block_rows(sorted_ids_ptr, b, M, BLOCK_M: tl.constexpr):
    """(sorted rows [4], their assignments [4], real-row mask [4]) of block b; entries past
    BLOCK_M are padding (their rows are never loaded or stored)."""
    pick = tl.arange(0, 4)
    rows = b * BLOCK_M + pick
    assign = tl.load(sorted_ids_ptr + rows, mask=pick < BLOCK_M, other=M)
    return rows, assign, assign < M


@triton.jit
def _gemv_h_store(g, u, row, assign, ok, weights_ptr, h_ptr, stride_h, offs_n, I, limit,
                  HAS_LIMIT: tl.constexpr, X_DTYPE: tl.constexpr):
    """h[row, n] = x's dtype(SwiGLU(g, u) * weight[assign]) for a real row (ok), else no-op."""
    if HAS_LIMIT:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    w = tl.load(weights_ptr + assign, mask=ok, other=0.0).to(tl.float32)
    h = g / (1.0 + tl.exp(-g)) * u * w
    tl.store(h_ptr + row.to(tl.int64) * stride_h + offs_n, h.to(X_DTYPE),
             mask=offs_n < I * ok.to(tl.int32))


@triton.jit
def _pick(v, i: tl.constexpr):
    """Element i of a [4] vector as a scalar."""
    return tl.sum(tl.where(tl.arange(0, 4) == i, v, 0))


@triton.jit
def _gemv_gate_up_kernel(
    a_ptr, w1_ptr, w1s_ptr, w3_ptr, w3s_ptr, sorted_ids_ptr, block_expert_ptr, weights_ptr,
    h_ptr, M, d, I, topk, stride_a, stride_we, stride_wn, stride_se, stride_sn, stride_h, limit,
    NUM_EXPERTS: tl.constexpr, HAS_LIMIT: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, X_DTYPE: tl.constexpr, CHUNKS: tl.constexpr,
):
    """_fp4_gate_up_kernel's contract (h rows in sorted order, x's dtype) for the gemv
    variant; A is x in x's dtype (FP8-rounded by the host with act_quant)."""
    b = tl.program_id(0)
    e = tl.load(block_expert_ptr + b).to(tl.int64)
    if e >= NUM_EXPERTS:
        return
    rows, assign, ok = _gemv_block_rows(sorted_ids_ptr, b, M, BLOCK_M)
    token = tl.where(ok, assign // topk, 0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < I
    g0, g1, g2, g3, u0, u1, u2, u3 = _gemv_rows(
        a_ptr, token, stride_a, w1_ptr, w1s_ptr, w3_ptr, w3s_ptr, e, offs_n, n_mask, d,
        stride_we, stride_wn, stride_se, stride_sn, True, BLOCK_M, BLOCK_N, CHUNKS)
    _gemv_h_store(g0, u0, _pick(rows, 0), _pick(assign, 0), _pick(ok.to(tl.int32), 0) > 0,
                  weights_ptr, h_ptr, stride_h, offs_n, I, limit, HAS_LIMIT, X_DTYPE)
    if BLOCK_M > 1:
        _gemv_h_store(g1, u1, _pick(rows, 1), _pick(assign, 1), _pick(ok.to(tl.int32), 1) > 0,
                      weights_ptr, h_ptr, stride_h, offs_n, I, limit, HAS_LIMIT, X_DTYPE)
    if BLOCK_M > 2:
        _gemv_h_store(g2, u2, _pick(rows, 2), _pick(assign, 2), _pick(ok.to(tl.int32), 2) > 0,
                      weights_ptr, h_ptr, stride_h, offs_n, I, limit, HAS_LIMIT, X_DTYPE)
        _gemv_h_store(g3, u3, _pick(rows, 3), _pick(assign, 3), _pick(ok.to(tl.int32), 3) > 0,
                      weights_ptr, h_ptr, stride_h, offs_n, I, limit, HAS_LIMIT, X_DTYPE)


@triton.jit
def _gemv_partial_store(acc, assign, ok, partial_ptr, stride_p, offs_n, d):
    tl.store(partial_ptr + assign.to(tl.int64) * stride_p + offs_n, acc,
             mask=offs_n < d * ok.to(tl.int32))


@triton.jit
def _gemv_down_kernel(
    h_ptr, w2_ptr, w2s_ptr, sorted_ids_ptr, block_expert_ptr, partial_ptr,
    M, d, I, stride_h, stride_we, stride_wn, stride_se, stride_sn, stride_p,
    NUM_EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CHUNKS: tl.constexpr,
):
    """_fp4_down_kernel's contract (fp32 partial per assignment) for the gemv variant; h in
    x's dtype (FP8-rounded by the host with act_quant)."""
    b = tl.program_id(0)
    e = tl.load(block_expert_ptr + b).to(tl.int64)
    if e >= NUM_EXPERTS:
        return
    rows, assign, ok = _gemv_block_rows(sorted_ids_ptr, b, M, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < d
    # A padding row reads the block's first row (always a real one): h's padding rows are
    # uninitialised, and garbage (NaN) need not flow through the math even unstored.
    h_rows = tl.where(ok, rows, b * BLOCK_M).to(tl.int64)
    g0, g1, g2, g3, _, _, _, _ = _gemv_rows(
        h_ptr, h_rows, stride_h, w2_ptr, w2s_ptr, w2_ptr, w2s_ptr, e, offs_n,
        n_mask, I, stride_we, stride_wn, stride_se, stride_sn, False, BLOCK_M, BLOCK_N, CHUNKS)
    oki = ok.to(tl.int32)
    _gemv_partial_store(g0, _pick(assign, 0), _pick(oki, 0) > 0, partial_ptr, stride_p, offs_n, d)
    if BLOCK_M > 1:
        _gemv_partial_store(g1, _pick(assign, 1), _pick(oki, 1) > 0, partial_ptr, stride_p,
                            offs_n, d)
    if BLOCK_M > 2:
        _gemv_partial_store(g2, _pick(assign, 2), _pick(oki, 2) > 0, partial_ptr, stride_p,
                            offs_n, d)
        _gemv_partial_store(g3, _pick(assign, 3), _pick(oki, 3) > 0, partial_ptr, stride_p,
                            offs_n, d)


def gemv_config(T: int, topk: int) -> dict:
    """The gemv variant's tiles (fixed per shape: graph capture), from the data file
    configs/fp4_gemv_moe_tiles.json (TILES_FILE, read at import) by M = T * topk.

    block_m follows the rows an expert holds (uniform routing over a 128-expert shard, top-6:
    ~1.2 per hit expert at T = 16, ~1.6 at T = 64): every row of a block costs one FMA per
    weight element, real or padding, and every extra block of an expert one more decode of its
    weights (~4.5 instructions per element), so 2-row blocks from T * topk > 96 and 4-row ones
    only past 384, where experts commonly hold 3 or more.

    Tiles: with a handful of experts hit, narrow N tiles with long K steps (16 / 32 weight
    rows x 512 inputs = 256 contiguous bytes per row and step, 8 KB per program and step), so
    the few experts still give hundreds of programs. Otherwise 64 x 128 input tiles (64 bytes
    per row and step, 8 KB over gate + up): a quarter of the programs (the static grid is
    max_blocks x N tiles, most blocks empty padding when few experts are hit, and an empty
    program still costs a launch) and fewer registers (sm_90: 120-130 gate/up, 70-80 down at
    block_m 2-4, where the narrow tiles took 128-215). chunks: 32-input chunks per K step
    (capped to divide K). 8 warps. Which tiers win was measured (the file names the device)."""
    return pick(_TIERS, T * topk)


def gemv_moe(x, w1, w1_scale, w3, w3_scale, w2, w2_scale, ids, weights, limit, out,
              act_quant: bool, cfg: dict):
    """fp4_fused_moe's gemv variant (arguments checked by the caller)."""
    T, d = x.shape
    E, I, _ = w1.shape
    topk = ids.shape[1]
    M = T * topk
    bm = cfg["block_m"]
    if bm not in (1, 2, 4):
        raise ValueError(f"fp4_fused_moe: the gemv variant takes block_m 1, 2 or 4, got {bm}")
    sorted_ids, block_expert = moe_align(ids, E, bm)
    max_blocks = block_expert.shape[0]
    dev = x.device
    # Activations in x's dtype, FP8-rounded per 128 with act_quant (exact there).
    a = round_act(x) if act_quant else x
    h = torch.empty(sorted_ids.shape[0], I, dtype=x.dtype, device=dev)
    partial = torch.empty(M, d, dtype=torch.float32, device=dev)
    weights_flat = weights.reshape(-1).float().contiguous()
    kw = dict(NUM_EXPERTS=E, BLOCK_M=bm, num_warps=cfg["num_warps"],
              num_stages=cfg["num_stages"])
    bn = cfg["block_n_up"]
    _gemv_gate_up_kernel[(max_blocks, cdiv(I, bn))](
        a, w1.view(torch.int32), w1_scale.view(torch.uint8), w3.view(torch.int32),
        w3_scale.view(torch.uint8), sorted_ids, block_expert, weights_flat, h,
        M, d, I, topk, a.stride(0), w1.stride(0) // 4, w1.stride(1) // 4, w1_scale.stride(0),
        w1_scale.stride(1), h.stride(0), float(limit), HAS_LIMIT=limit > 0, BLOCK_N=bn,
        X_DTYPE=TL_DTYPE[x.dtype], CHUNKS=chunks(d, cfg["chunks"]), **kw)
    if act_quant:  # padding rows are rounded too, never read
        h = round_act(h)
    bn = cfg["block_n_down"]
    _gemv_down_kernel[(max_blocks, cdiv(d, bn))](
        h, w2.view(torch.int32), w2_scale.view(torch.uint8), sorted_ids, block_expert, partial,
        M, d, I, h.stride(0), w2.stride(0) // 4, w2.stride(1) // 4, w2_scale.stride(0),
        w2_scale.stride(1), partial.stride(0), BLOCK_N=bn, CHUNKS=chunks(I, cfg["chunks"]),
        **kw)
    return sum_topk(partial, ids, out, E)
