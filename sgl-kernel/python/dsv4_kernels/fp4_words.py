"""Packed FP4 (e2m1) expert weights read as int32 words and decoded two codes at a time:
shared by the FP4 MoE's bf16 variant (fp4_moe.py, its pair decode) and the gemv variant
(fp4_gemv_moe.py). Codes come out as exact fp32 values x 2^-14 beside their e8m0 chunk scales.
"""

import torch
import triton
import triton.language as tl

TL_DTYPE = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def chunks(K: int, most: int = 4) -> int:
    """32-input chunks per K step: the largest power of two <= most whose step divides K."""
    return next(c for c in (16, 8, 4, 2, 1) if c <= most and K % (32 * c) == 0)


@triton.jit
def load_words(w_ptr, s_ptr, e, offs_n, n_mask, k0, stride_we, stride_wn, stride_se,
               stride_sn, CHUNKS: tl.constexpr):
    """Raw weight rows n of expert e at inputs k0 .. k0 + 32 * CHUNKS - 1: (packed int32 words
    [BN, CHUNKS, 4], 16 * CHUNKS contiguous bytes per row, w_ptr and stride_* in words; e8m0
    bytes [BN, CHUNKS])."""
    j = k0 // 8 + tl.arange(0, CHUNKS)[None, :, None] * 4 + tl.arange(0, 4)[None, None, :]
    word = tl.load(w_ptr + e * stride_we + offs_n[:, None, None] * stride_wn + j,
                   mask=n_mask[:, None, None], other=0)
    c = k0 // 32 + tl.arange(0, CHUNKS)
    sb = tl.load(s_ptr + e * stride_se + offs_n[:, None] * stride_sn + c[None, :],
                 mask=n_mask[:, None], other=0)
    return word, sb


@triton.jit
def nibbles_x2m14(word, i: tl.constexpr):
    """Codes i and i + 4 (bits 4i .. 4i + 3 and 16 higher) of each int32 word as their e2m1
    values x 2^-14 in fp32, exact: a code's 3 magnitude bits placed at bits 9-11 of an fp16
    (the two exponent bits at the bottom of fp16's exponent, the mantissa bit at the top of
    its mantissa) and its sign at bit 15 give e2m1 x 2^-14 for every code, e2m1's own
    subnormal 0.5 becoming an fp16 subnormal; fp16 -> fp32 is exact (no flush: subnormal only
    on the fp16 side). The two codes sit 16 bits apart, as the halves of an fp16 pair do, so
    one shift-and-merge builds both patterns; each half then converts alone."""
    x = word >> (4 * i)  # arithmetic shift: the masks below drop the sign fill
    pair = ((x << 9) & 0x0E000E00) | ((x << 12) & -0x7FFF8000)  # 0x80008000 as an int32
    lo = (pair & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = ((pair >> 16) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def decode_words(word, sb):
    """load_words' words -> (fp32 e2m1 values x 2^-14 [BN, CHUNKS, 32], fp32 chunk scales
    [BN, CHUNKS] = 2^(byte - 127), byte 0 -> 0). Code i of a word (little-endian, element 2j
    in byte j's low nibble) is input 8 * word + i: three rounds of interleaving put them in
    order (interleave(a, b)[2j + t] = (a, b)[t][j]; in-thread, no data moves)."""
    n0, n4 = nibbles_x2m14(word, 0)
    n1, n5 = nibbles_x2m14(word, 1)
    n2, n6 = nibbles_x2m14(word, 2)
    n3, n7 = nibbles_x2m14(word, 3)
    c0 = tl.interleave(n0, n4)
    c1 = tl.interleave(n1, n5)
    c2 = tl.interleave(n2, n6)
    c3 = tl.interleave(n3, n7)
    w = tl.interleave(tl.interleave(c0, c2), tl.interleave(c1, c3))
    return w, ((sb.to(tl.int32) & 0xFF) << 23).to(tl.float32, bitcast=True)
