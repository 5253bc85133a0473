"""Triton FP4 MoE: the routed experts in the release format (packed e2m1 int8 [E, out, in/2],
two codes per byte with element 2j in the low nibble, e8m0 uint8 scales [E, out, in/32]),
decoded inside the GEMM kernels. quant_reference.fp4_moe_ref is the contract; the routing,
alignment and top-k sum are moe.py's (moe_align, sum_topk): same skipped-id and
weight-order semantics as fused_moe.

Hopper has no FP4 MMA, so the weights are decoded in the kernels; two variants, picked by
`variant` (the ones that were fastest somewhere on an H200):
- "bf16": e2m1 x scale -> x's dtype (exact), tl.dot in that dtype. With act_quant, x and the
  weighted activation are rounded to FP8 per 128 first, by their own kernel (round_act), and
  fed dequantized (exact), so the products are those of the release. The default from 97
  assignments (moe_config's step_dot): a whole 128-input step decoded at once, its chunk
  scales folded in, two codes per shift-and-merge (_decode_step), and one dot per step; the
  default variant beyond gemv's range.
  Per 32-input chunk (without step_dot): per weight row 16 packed bytes (one vector load,
  nibbles split and interleaved in registers) and one scale byte, so a step costs two loads per
  row rather than one per element. Accumulates in fp32, fp32 per-assignment partials, summed in
  a fixed order.

- "gemv": for decode-sized batches, no MMA: an FMA GEMV that decodes each weight once per
  block of 1-4 rows of one expert (fp4_gemv_moe.py: tiles, decode, numerics).
  default_variant picks it at T * topk <= GEMV_MAX_ASSIGNMENTS (release numerics on bf16/fp16
  activations: where it was measured; fp32 and weight-only calls keep the bf16 decode).

On Hopper, the humming MoE backend (sglang's layers/moe/backends/humming_moe.py) is faster at
every batch; this kernel is the portable path (any float dtype, exact fp32 products, the
interpreter on CPU).

Graph-safe: buffers sized by (T, topk, E) only, no host syncs, tiles fixed per shape.
An e8m0 byte 0 or 1 (2^-127, 2^-126) decodes as 0 in the bf16 variant's per-chunk decode
(_e2m1_scaled), byte 0 alone in the pair decode (the reference keeps the values): no real scale
is that small.
"""

import functools

import torch
import triton
import triton.language as tl

from . import fp4_gemv_moe
from ._dot import dot_precision
from .fp4_words import TL_DTYPE, chunks, decode_words, load_words
from .fp8_act_quant import QBLOCK, round_act
from .host_math import cdiv
from .moe import moe_align, sum_topk
from .tile_tables import CONFIGS, load_tiers, pick

VARIANTS = ("bf16", "gemv")
TILES_FILE = CONFIGS / "fp4_moe_tiles.json"
# default_variant picks the gemv variant at T * topk <= this: on an H200 (128-expert shard,
# release numerics) gemv was faster than the one-dot bf16 decode at T = 1 and 16 and slower
# from T = 32 on (the `moe-backends` suite's variants_decode / variants_mid items measure both).
GEMV_MAX_ASSIGNMENTS = 16 * 6


@triton.jit
def _load_codes(w_ptr, e, offs_n, n_mask, k0, stride_we, stride_wn):
    """[BN, 32] e2m1 codes of expert e, rows n, inputs k0..k0+31: 16 contiguous bytes per row
    (one vector load), element 2j from byte j's low nibble, 2j+1 from its high one."""
    j = k0 // 2 + tl.arange(0, 16)
    byte = tl.load(w_ptr + e * stride_we + offs_n[:, None] * stride_wn + j[None, :],
                   mask=n_mask[:, None], other=0).to(tl.int32) & 0xFF
    return tl.interleave(byte & 0xF, byte >> 4)


@triton.jit
def _step_scales(s_ptr, e, offs_n, n_mask, k0, stride_se, stride_sn, CHUNKS: tl.constexpr):
    """[BN, CHUNKS] int32 e8m0 bytes (scale 2^(byte - 127)) of inputs k0 .. k0 + 32 * CHUNKS - 1
    of each row, one contiguous CHUNKS-byte load per row (wide enough for the pipeliner's async
    copies, where a byte per row and step was a load whose latency every step waited out)."""
    c = k0 // 32 + tl.arange(0, CHUNKS)
    return tl.load(s_ptr + e * stride_se + offs_n[:, None] * stride_sn + c[None, :],
                   mask=n_mask[:, None], other=0).to(tl.int32) & 0xFF


@triton.jit
def _chunk_scale(scales, c: tl.constexpr, CHUNKS: tl.constexpr):
    """Column c of [BN, CHUNKS] scales as [BN] (a masked sum: one row's CHUNKS values sit in
    one thread, so no data moves between threads)."""
    pick = tl.arange(0, CHUNKS)[None, :] == c
    return tl.sum(tl.where(pick, scales, 0), axis=1)


@triton.jit
def _e2m1_scaled(code, sbyte):
    """e2m1 codes x 2^(sbyte - 127) -> fp32, exact, built as bits (sbyte: e8m0 bytes as int32,
    shaped to broadcast against the codes, e.g. [BN, 1] for one scale per row): magnitude
    codes 2..7 (1, 1.5, 2, 3, 4, 6) are 0.5 * 2^(c >> 1) with mantissa bit c & 1, i.e. fp32
    bits (126 << 23) + (c << 22), and code 1 (0.5) is (126 << 23); the scale adds
    (sbyte - 127) to the exponent. No int->float conversion or multiply (this decode is the
    large-batch bottleneck). Bytes 0 and 1 (2^-127, 2^-126: no real scale) give 0."""
    mag = code & 7
    bits = ((sbyte - 1) << 23) + ((mag - (mag == 1).to(tl.int32)) << 22)
    bits = tl.where((mag == 0) | (sbyte < 2), 0, bits) | ((code & 8) << 28)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _decode_step(w_ptr, s_ptr, e, offs_n, n_mask, k0, stride_we, stride_wn, stride_se, stride_sn,
                 CHUNKS: tl.constexpr, DTYPE: tl.constexpr, PAIR_DECODE: tl.constexpr):
    """[BN, 32 * CHUNKS] weights of expert e, rows n, inputs k0 .. k0 + 32 * CHUNKS - 1, decoded
    exactly to DTYPE with each chunk's scale folded in (e2m1 x a power of two): one wide code load
    and one scale load per row, one decode, for a single dot over the whole step.
    PAIR_DECODE (w_ptr and its strides in int32 words): the gemv variant's decode, two codes per
    shift-and-merge as fp16 bits (decode_words: e2m1 x 2^-14 in fp32), times the chunk's scale
    x 2^14 (a power of two: exact), about 6 instructions per code against _e2m1_scaled's ~14
    (the decode bounds the large-batch MoE); an e8m0 byte 1 is kept, 0 gives 0. Otherwise
    (bytes): _e2m1_scaled."""
    if PAIR_DECODE:
        word, sb = load_words(w_ptr, s_ptr, e, offs_n, n_mask, k0, stride_we, stride_wn,
                               stride_se, stride_sn, CHUNKS)
        x, s = decode_words(word, sb)
        w = (x * (s * 16384.0)[:, :, None]).to(DTYPE)
    else:
        j = k0 // 2 + tl.arange(0, CHUNKS)[None, :, None] * 16 + tl.arange(0, 16)[None, None, :]
        byte = tl.load(w_ptr + e * stride_we + offs_n[:, None, None] * stride_wn + j,
                       mask=n_mask[:, None, None], other=0).to(tl.int32) & 0xFF
        code = tl.interleave(byte & 0xF, byte >> 4)  # [BN, CHUNKS, 32]
        sb = _step_scales(s_ptr, e, offs_n, n_mask, k0, stride_se, stride_sn, CHUNKS)
        w = _e2m1_scaled(code, sb[:, :, None]).to(DTYPE)
    return tl.reshape(w, (w.shape[0], 32 * CHUNKS))


@triton.jit
def _expert_gemm(acc, acc3, a_ptr, a_rows, row_mask, stride_a,
                 w_ptr, s_ptr, w3_ptr, s3_ptr, e, offs_n, n_mask, K, stride_we, stride_wn,
                 stride_se, stride_sn, PAIR: tl.constexpr, DOT_PREC: tl.constexpr,
                 CHUNKS: tl.constexpr, STEP_DOT: tl.constexpr, PAIR_DECODE: tl.constexpr):
    """acc += A[a_rows] @ W_e^T over K, and with PAIR also acc3 += A[a_rows] @ W3_e^T (same
    shapes and strides: the gate and up projections share each A tile, and their weight loads
    are in flight together). A step covers CHUNKS x 32 inputs (CHUNKS in 1, 2, 4; 32 * CHUNKS
    divides K and 128): one load of the step's weight scales, then per 32-input chunk (one
    weight scale per row) a 16-byte code load per row and a dot. A is in x's dtype (with
    act_quant already rounded to FP8 per 128 by the host: round_act).
    STEP_DOT: the step's chunks decoded together, their scales folded in, and one dot per step
    instead of one per chunk (a decoded operand passes through shared memory before each dot:
    4x fewer round trips and waits); PAIR_DECODE: _decode_step's (w_ptr, w3_ptr and stride_we /
    stride_wn then in int32 words)."""
    for k0 in range(0, K, 32 * CHUNKS):
        if STEP_DOT:  # the whole step in one dot (scales folded into the weights)
            kk = k0 + tl.arange(0, 32 * CHUNKS)
            a = tl.load(a_ptr + a_rows[:, None] * stride_a + kk[None, :],
                        mask=row_mask[:, None], other=0.0)
            b = _decode_step(w_ptr, s_ptr, e, offs_n, n_mask, k0, stride_we, stride_wn,
                             stride_se, stride_sn, CHUNKS, a.dtype, PAIR_DECODE)
            acc = tl.dot(a, tl.trans(b), acc, input_precision=DOT_PREC)
            if PAIR:
                b3 = _decode_step(w3_ptr, s3_ptr, e, offs_n, n_mask, k0, stride_we, stride_wn,
                                  stride_se, stride_sn, CHUNKS, a.dtype, PAIR_DECODE)
                acc3 = tl.dot(a, tl.trans(b3), acc3, input_precision=DOT_PREC)
        else:
            sb_step = _step_scales(s_ptr, e, offs_n, n_mask, k0, stride_se, stride_sn, CHUNKS)
            if PAIR:
                sb3_step = _step_scales(s3_ptr, e, offs_n, n_mask, k0, stride_se, stride_sn,
                                        CHUNKS)
            for c in tl.static_range(CHUNKS):
                kk = k0 + c * 32 + tl.arange(0, 32)
                a = tl.load(a_ptr + a_rows[:, None] * stride_a + kk[None, :],
                            mask=row_mask[:, None], other=0.0)
                code = _load_codes(w_ptr, e, offs_n, n_mask, k0 + c * 32, stride_we, stride_wn)
                sb = _chunk_scale(sb_step, c, CHUNKS)
                b = _e2m1_scaled(code, sb[:, None]).to(a.dtype)  # exact: e2m1 x 2^k
                acc = tl.dot(a, tl.trans(b), acc, input_precision=DOT_PREC)
                if PAIR:
                    code3 = _load_codes(w3_ptr, e, offs_n, n_mask, k0 + c * 32, stride_we,
                                        stride_wn)
                    sb3 = _chunk_scale(sb3_step, c, CHUNKS)
                    b3 = _e2m1_scaled(code3, sb3[:, None]).to(a.dtype)
                    acc3 = tl.dot(a, tl.trans(b3), acc3, input_precision=DOT_PREC)
    return acc, acc3


@triton.jit
def _fp4_gate_up_kernel(
    a_ptr, w1_ptr, w1s_ptr, w3_ptr, w3s_ptr, sorted_ids_ptr, block_expert_ptr,
    weights_ptr, h_ptr,
    M, d, I, topk, stride_a, stride_we, stride_wn, stride_se, stride_sn,
    stride_h, limit,
    NUM_EXPERTS: tl.constexpr, HAS_LIMIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr, X_DTYPE: tl.constexpr,
    CHUNKS: tl.constexpr, STEP_DOT: tl.constexpr, PAIR_DECODE: tl.constexpr,
):
    """h[row] = x's dtype(SwiGLU(x W1^T, x W3^T) * routing weight) for this block's rows. With
    act_quant the host then rounds h to FP8 per 128 (its own small kernel: a tile here need not
    span a whole 128-block, so small batches can use narrow tiles and more programs)."""
    b = tl.program_id(0)
    e = tl.load(block_expert_ptr + b).to(tl.int64)
    if e >= NUM_EXPERTS:  # a padding block past every expert's group
        return
    rows = b * BLOCK_M + tl.arange(0, BLOCK_M)
    assign = tl.load(sorted_ids_ptr + rows)
    row_mask = assign < M
    token = (assign // topk).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < I
    acc1 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc3 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc1, acc3 = _expert_gemm(acc1, acc3, a_ptr, token, row_mask, stride_a,
                              w1_ptr, w1s_ptr, w3_ptr, w3s_ptr, e, offs_n, n_mask, d,
                              stride_we, stride_wn, stride_se, stride_sn, True,
                              DOT_PREC, CHUNKS, STEP_DOT, PAIR_DECODE)
    if HAS_LIMIT:
        acc1 = tl.minimum(acc1, limit)
        acc3 = tl.minimum(tl.maximum(acc3, -limit), limit)
    # Weighted in fp32, then rounded to x's dtype before the down GEMM (or its FP8 rounding).
    w = tl.load(weights_ptr + assign, mask=row_mask, other=0.0).to(tl.float32)
    h = acc1 / (1.0 + tl.exp(-acc1)) * acc3 * w[:, None]
    tl.store(h_ptr + rows.to(tl.int64)[:, None] * stride_h + offs_n[None, :], h.to(X_DTYPE),
             mask=row_mask[:, None] & n_mask[None, :])


@triton.jit
def _fp4_down_kernel(
    h_ptr, w2_ptr, w2s_ptr, sorted_ids_ptr, block_expert_ptr, partial_ptr,
    M, d, I, stride_h, stride_we, stride_wn, stride_se, stride_sn,
    stride_p,
    NUM_EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PREC: tl.constexpr, CHUNKS: tl.constexpr,
    STEP_DOT: tl.constexpr, PAIR_DECODE: tl.constexpr,
):
    b = tl.program_id(0)
    e = tl.load(block_expert_ptr + b).to(tl.int64)
    if e >= NUM_EXPERTS:
        return
    rows = b * BLOCK_M + tl.arange(0, BLOCK_M)
    assign = tl.load(sorted_ids_ptr + rows)
    row_mask = assign < M
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < d
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    # h is already rounded as the down GEMM needs it (x's dtype; FP8 values with act_quant)
    acc, _ = _expert_gemm(acc, acc, h_ptr, rows.to(tl.int64), row_mask, stride_h,
                          w2_ptr, w2s_ptr, w2_ptr, w2s_ptr, e, offs_n,
                          n_mask, I, stride_we, stride_wn, stride_se, stride_sn, False,
                          DOT_PREC, CHUNKS, STEP_DOT, PAIR_DECODE)
    tl.store(partial_ptr + assign.to(tl.int64)[:, None] * stride_p + offs_n[None, :], acc,
             mask=row_mask[:, None] & n_mask[None, :])


@functools.lru_cache(maxsize=None)
def _tile_tiers() -> tuple:
    return load_tiers(TILES_FILE)


def moe_config(T: int, topk: int, x_dtype: torch.dtype = torch.bfloat16) -> dict:
    """Tiles by assignment count M = T * topk, no autotuning (graph capture), from the data file
    configs/fp4_moe_tiles.json (TILES_FILE, read once; sweep_moe_tiles.py compares its tiles
    with alternatives). With uniform
    routing an expert gets about M / 256 rows at Flash's 256 experts, sharded or not (a shard's
    experts see every rank's tokens), and that count picks the rows per tile: a tile wider than
    an expert's rows computes padding, one narrower decodes the expert's weights once per tile.

    Few assignments (decode, small batches) are bandwidth-bound: each expert hit has one
    16-row block, so the programs are (experts hit) x (N tiles), and narrow N tiles put more
    of them on the weights (T = 1, top-6: 6 x 2048/16 gate/up and 6 x 4096/32 down programs,
    where 128-wide tiles gave 96 and 192; 2 warps, as a 16 x 16 tile leaves little to share).
    From 97 assignments one dot per 128-input step (step_dot), 16-row tiles up to ~12 rows per
    expert, 32-row tiles up to ~32, 64-row tiles up to ~64, then 128-row tiles: the cost is
    per tile (each decodes its expert's weights), so the narrowest tile that holds an expert's
    rows wins (the tier edges are where the H200 measured the next tile size winning; the
    `moe-tiles` suite's sweep item times each tier against its alternatives and writes this
    file's format).
    num_stages is the software pipeline depth. fp32 activations (x_dtype) double every operand
    tile, and the wide 128-row tiles would need
    288 KiB of shared memory (sm_90 has 227): they keep 64 / 128-wide N tiles.

    step_dot (bf16 decode only): one dot per 128-input step instead of one per 32-input chunk,
    from 97 assignments up, where it was measured faster than the per-chunk dots and than an
    e4m3 decode on FP8 tensor cores (2.1-3.3x; default_variant). pair_decode (with step_dot;
    default on): _decode_step's two-codes-per-shift decode instead of _e2m1_scaled, 1.3-2.0x
    faster at T = 64-4096 on an H200 (bench_quant.py's bf16_release against
    bf16_release_bitdecode)."""
    return pick(_tile_tiers(), T * topk, fp32=x_dtype == torch.float32)



def default_variant(T: int, topk: int) -> str:
    """The fastest variant for release numerics at this batch, as measured on an H200 at top-6:
    gemv at T * topk <= GEMV_MAX_ASSIGNMENTS (faster at T = 1 and 16), the bf16 decode with one
    dot per 128-input step and the pair decode beyond (1.02 / 1.31 / 1.90 / 3.30 ms against
    gemv's 1.67 / 5.11 ms at T = 64 / 256 / 1024 / 4096, 128-expert shard, bench_quant.py
    --only moe --quick --moe-t 64 256 1024 4096)."""
    return "gemv" if 0 < T * topk <= GEMV_MAX_ASSIGNMENTS else "bf16"


def select_variant(T: int, topk: int, act_quant: bool, x_dtype: torch.dtype) -> str:
    """The decode fp4_fused_moe uses when none is given: default_variant for release numerics
    on bf16/fp16 activations (where the variants were measured), else "bf16" (fp32 x stays on
    exact fp32 products; weight-only numerics keep the decode they were validated with)."""
    return default_variant(T, topk) if act_quant and x_dtype != torch.float32 else "bf16"


def fp4_fused_moe(x, w1, w1_scale, w3, w3_scale, w2, w2_scale, ids, weights, limit, out,
                  act_quant: bool, variant: str | None = None, config: dict | None = None):
    """out fp32 [T, d] <- quant_reference.fp4_moe_ref(...) (see the module docstring).
    variant None: select_variant (default_variant for bf16/fp16 x with act_quant, else "bf16").
    config: moe_config's keys, or gemv_config's for the gemv variant."""
    if variant is None:
        variant = select_variant(*ids.shape, act_quant, x.dtype)
    if variant not in VARIANTS:
        raise ValueError(f"fp4_fused_moe: variant must be one of {VARIANTS}, got {variant!r}")
    T, d = x.shape
    E, I, half_d = w1.shape
    if (half_d * 2 != d or w3.shape != w1.shape or w2.shape != (E, d, I // 2)
            or w1.dtype not in (torch.int8, torch.uint8)):
        raise ValueError(f"fp4_fused_moe: w1/w3 {tuple(w1.shape)} {w1.dtype}, w2 "
                         f"{tuple(w2.shape)} do not fit x [T, {d}] (packed int8 [E, out, in/2])")
    for s, want, name in ((w1_scale, (E, I, d // 32), "w1"), (w3_scale, (E, I, d // 32), "w3"),
                          (w2_scale, (E, d, I // 32), "w2")):
        if tuple(s.shape) != want or s.element_size() != 1:
            raise ValueError(f"fp4_fused_moe: {name}_scale must be e8m0 bytes {want}, got "
                             f"{s.dtype} {tuple(s.shape)}")
    multiple = QBLOCK if act_quant else 32  # FP8 activation blocks / the FP4 scale blocks
    if d % multiple or I % multiple:
        raise ValueError(f"fp4_fused_moe: hidden {d} and inter {I} must be multiples of "
                         f"{multiple}{' with act_quant' if act_quant else ''}")
    assert x.stride(-1) == 1 and out.shape == (T, d) and out.stride(-1) == 1
    assert all(t.is_contiguous() for t in (w1, w3, w2, w1_scale, w3_scale, w2_scale))
    if T == 0:
        return out
    if variant == "gemv":
        return fp4_gemv_moe.gemv_moe(x, w1, w1_scale, w3, w3_scale, w2, w2_scale, ids, weights, limit,
                                     out, act_quant, config or fp4_gemv_moe.gemv_config(T, ids.shape[1]))
    cfg = config or moe_config(T, ids.shape[1], x.dtype)
    bm = cfg["block_m"]
    topk = ids.shape[1]
    M = T * topk
    sorted_ids, block_expert = moe_align(ids, E, bm)
    max_blocks = block_expert.shape[0]
    rows = sorted_ids.shape[0]
    dev = x.device
    # The gate/up GEMM's input: with act_quant, x rounded to FP8 per 128, as the (exact)
    # dequantized values in x's dtype (once here, not in every N tile of the kernel: that
    # dequantization was a third of its loop at 4096 tokens).
    a = round_act(x) if act_quant else x
    h = torch.empty(rows, I, dtype=x.dtype, device=dev)
    partial = torch.empty(M, d, dtype=torch.float32, device=dev)
    weights_flat = weights.reshape(-1).float().contiguous()
    xdt = TL_DTYPE[x.dtype]
    prec = dot_precision(x.dtype)
    step = bool(cfg.get("step_dot"))
    # The pair decode reads the packed codes as int32 words: views and strides in words.
    words = step and cfg.get("pair_decode", True)
    unit = 4 if words else 1
    wview = torch.int32 if words else torch.int8
    kw = dict(NUM_EXPERTS=E, BLOCK_M=bm, DOT_PREC=prec, STEP_DOT=step, PAIR_DECODE=words,
              num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    bn = cfg["block_n_up"]
    _fp4_gate_up_kernel[(max_blocks, cdiv(I, bn))](
        a, w1.view(wview), w1_scale.view(torch.uint8), w3.view(wview),
        w3_scale.view(torch.uint8), sorted_ids, block_expert, weights_flat, h,
        M, d, I, topk, a.stride(0), w1.stride(0) // unit, w1.stride(1) // unit,
        w1_scale.stride(0), w1_scale.stride(1), h.stride(0), float(limit),
        HAS_LIMIT=limit > 0, X_DTYPE=xdt, BLOCK_N=bn, CHUNKS=chunks(d), **kw)
    # The down GEMM's input: with act_quant, h rounded to FP8 per 128 as the dequantized values
    # in x's dtype (padding rows are rounded too, never read).
    if act_quant:
        h = round_act(h)
    bn = cfg["block_n_down"]
    _fp4_down_kernel[(max_blocks, cdiv(d, bn))](
        h, w2.view(wview), w2_scale.view(torch.uint8), sorted_ids, block_expert,
        partial, M, d, I, h.stride(0), w2.stride(0) // unit, w2.stride(1) // unit,
        w2_scale.stride(0), w2_scale.stride(1), partial.stride(0), BLOCK_N=bn,
        CHUNKS=chunks(I), **kw)
    return sum_topk(partial, ids, out, E)
