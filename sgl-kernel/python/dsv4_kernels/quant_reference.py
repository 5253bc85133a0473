"""The release weight/activation formats in plain torch (any device): the single torch copy of
every quantization formula, bit-exact semantics that the Triton kernels and the model follow.

Formats (DeepSeek-V4's release):
- FP8 e4m3 with a power-of-two scale per block (ue8m0: the scale is stored as its exponent byte).
  Linears: weight e4m3 [N, K] + fp32 scale [ceil(N/128), ceil(K/128)]; activations per 128
  along K. KV nope dims per 64.
- FP4 e2m1 with a power-of-two scale per 32 inputs. Routed experts: int8 [E, out, in/2], two
  codes per byte (element 2j in the low nibble), bit 3 = sign, bits 0-2 index E2M1_VALUES;
  scales uint8 e8m0 [E, out, in/32] (value 2^(bits - 127)).

Scales follow the release kernels' act_quant: amax is floored at AMAX_FLOOR (so an all-zero
block gets a finite scale and maps to zeros, no NaN), multiplied by the fp32 reciprocal of the
format's max, then rounded up to a power of two by its exponent bits (exact, no log2).
"""

import struct

import torch

E4M3_MAX = 448.0
E2M1_MAX = 6.0
# The release kernels floor each block's amax here before taking its scale (an all-zero block
# gets 2^-22 for e4m3 and 2^-15 for e2m1; any scale maps zeros to zeros).
AMAX_FLOOR = 1e-4
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP8_BLOCK = 128
FP4_BLOCK = 32

_FP8 = torch.float8_e4m3fn


def _check_blocks(x: torch.Tensor, block: int, what: str) -> None:
    if x.dim() == 0 or x.shape[-1] % block != 0:
        raise ValueError(f"{what}: last dim {tuple(x.shape)[-1:]} is not a multiple of the "
                         f"block size {block}")


def _fp32_reciprocal(q: float) -> float:
    """1/q rounded to fp32, as a Python float (plain host math: no tensor, no device read)."""
    return struct.unpack("f", struct.pack("f", 1.0 / q))[0]


def pow2_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """fp32 scale per amax: the smallest power of two >= max(amax, AMAX_FLOOR) * fp32(1/qmax)
    (the release's ue8m0 rounding; exact powers of two stay as they are)."""
    # fp32(1/qmax) as a Python number (a float32 multiply by it rounds as by the fp32 tensor):
    # no tensor is built per call, so this runs inside a CUDA graph capture
    s = amax.float().clamp(min=AMAX_FLOOR) * _fp32_reciprocal(qmax)
    bits = s.view(torch.int32)
    exp = (bits >> 23) & 0xFF
    exp = exp + ((bits & 0x7FFFFF) != 0).to(torch.int32)  # round up unless already 2^k
    return (exp << 23).view(torch.float32)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    return x.float().unflatten(-1, (x.shape[-1] // block, block))


def quantize_fp8_blocks(x: torch.Tensor, block: int = FP8_BLOCK):
    """(q float8_e4m3fn like x, scale fp32 [..., K/block]): per `block` along the last dim,
    q = x / scale (exact: scale is a power of two) cast to e4m3, round to nearest even,
    saturating at +-448. x.shape[-1] % block == 0 required."""
    _check_blocks(x, block, "quantize_fp8_blocks")
    xb = _blocks(x, block)
    scale = pow2_scale(xb.abs().amax(dim=-1), E4M3_MAX)
    q = (xb / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(_FP8)
    return q.flatten(-2), scale


def fp8_round_blocks(x: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """x quantized per block to e4m3 then dequantized, in x's dtype (exact in bf16/fp32: an
    e4m3 value times a power of two)."""
    q, scale = quantize_fp8_blocks(x, block)
    return (_blocks(q, block) * scale[..., None]).flatten(-2).to(x.dtype)


def _round_e2m1(a: torch.Tensor) -> torch.Tensor:
    """|values| in [0, 6] -> the nearest e2m1 magnitude, ties to the even code (IEEE RNE on a
    2-bit-exponent, 1-bit-mantissa format: spacing 0.5 below 2, 1 below 4, 2 up to 6)."""
    step = torch.where(a < 2, 0.5, torch.where(a < 4, 1.0, 2.0))
    return (torch.round(a / step) * step).clamp(max=E2M1_MAX)  # torch.round: half to even


def fp4_round_blocks(x: torch.Tensor, block: int = FP4_BLOCK) -> torch.Tensor:
    """x rounded per block to e2m1 with a power-of-two scale >= amax/6, dequantized, x's dtype."""
    _check_blocks(x, block, "fp4_round_blocks")
    xb = _blocks(x, block)
    scale = pow2_scale(xb.abs().amax(dim=-1), E2M1_MAX)[..., None]
    v = xb / scale
    return (torch.sign(v) * _round_e2m1(v.abs().clamp(max=E2M1_MAX)) * scale).flatten(-2).to(x.dtype)


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """Walsh-Hadamard transform (Sylvester order) over the last dim (a power of two) times
    dim^-0.5, computed in fp32 by butterflies (h = 1, 2, 4, ...), returned in x's dtype."""
    n = x.shape[-1]
    if n <= 0 or n & (n - 1):
        raise ValueError(f"hadamard_rotate: last dim {n} is not a power of two")
    y = x.float()
    h = 1
    while h < n:
        y = y.unflatten(-1, (n // (2 * h), 2, h))
        a, b = y[..., 0, :], y[..., 1, :]
        y = torch.stack((a + b, a - b), dim=-2).flatten(-3)
        h *= 2
    return (y * n ** -0.5).to(x.dtype)


def e8m0_to_fp32(u8: torch.Tensor) -> torch.Tensor:
    """Raw e8m0 exponent bytes (uint8, or torch.float8_e8m0fnu viewed as bytes) -> fp32
    2^(bits - 127). 0 maps to 2^-127 (an fp32 subnormal); 255 (NaN in e8m0) is refused."""
    if u8.dtype != torch.uint8:
        if u8.element_size() != 1:
            raise TypeError(f"e8m0_to_fp32: expected uint8 exponent bytes, got {u8.dtype}")
        u8 = u8.view(torch.uint8)
    bits = u8.to(torch.int32)
    # a Python scalar, not a tensor copied to u8's device: capturable in a CUDA graph
    return torch.where(bits == 0, 2.0 ** -127, (bits << 23).view(torch.float32))


def fp32_to_e8m0(scale: torch.Tensor) -> torch.Tensor:
    """fp32 powers of two in [2^-126, 2^127] -> their uint8 e8m0 exponent bytes. Anything else
    (not a power of two, <= 0, inf/NaN) is refused: it would not round-trip."""
    s = scale.float()
    bits = s.view(torch.int32)
    ok = (s > 0) & torch.isfinite(s) & ((bits & 0x7FFFFF) == 0) & (((bits >> 23) & 0xFF) > 0)
    if not bool(ok.all()):
        bad = s[~ok].flatten()[:4].tolist()
        raise ValueError(f"fp32_to_e8m0: scales must be normal positive powers of two, got {bad}")
    return ((bits >> 23) & 0xFF).to(torch.uint8)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """int8/uint8 [..., K/2] -> fp32 [..., K]: element 2j from the low nibble, 2j+1 from the high
    one; a code's bit 3 is the sign, bits 0-2 index E2M1_VALUES."""
    if packed.dtype not in (torch.int8, torch.uint8):
        raise TypeError(f"unpack_fp4: expected int8/uint8 packed codes, got {packed.dtype}")
    b = packed.view(torch.uint8).to(torch.int32)
    codes = torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2)
    return _e2m1_values(codes)


def _e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """Codes 0..15 (int) -> fp32 E2M1_VALUES[code & 7], negated when bit 3 is set (code 8 is
    -0.0), by arithmetic on the codes' own device: no value table is copied there, so the
    decode runs inside a CUDA graph capture. Magnitude codes 2..7 are (1 + m/2) 2^(e - 1) with
    e = code >> 1 and m = code & 1; code 1 (e = 0) is the subnormal 0.5."""
    mag = codes & 7
    e, m = mag >> 1, (mag & 1).float()
    v = torch.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * torch.exp2((e - 1).float()))
    return torch.where((codes & 8) != 0, -v, v)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Codes 0..15 [..., K] (K even) -> int8 [..., K/2], element 2j in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4: last dim {codes.shape[-1]} is odd")
    c = codes.to(torch.int64)
    if bool(((c < 0) | (c > 15)).any()):
        raise ValueError("pack_fp4: codes must be in [0, 15]")
    c = c.unflatten(-1, (c.shape[-1] // 2, 2))
    return (c[..., 0] | (c[..., 1] << 4)).to(torch.uint8).view(torch.int8)


def quantize_fp4(x: torch.Tensor, block: int = FP4_BLOCK):
    """(packed int8 [..., K/2], scale uint8 e8m0 [..., K/block]) with dequantize_fp4(...) ==
    fp4_round_blocks(x, block): for checkpoint writers, dummy weights and tests."""
    _check_blocks(x, block, "quantize_fp4")
    xb = _blocks(x, block)
    scale = pow2_scale(xb.abs().amax(dim=-1), E2M1_MAX)
    v = (xb / scale[..., None]).flatten(-2)
    mag = _round_e2m1(v.abs().clamp(max=E2M1_MAX))
    idx = torch.searchsorted(torch.tensor(E2M1_VALUES, device=x.device), mag.contiguous())
    codes = idx + 8 * ((v < 0) & (mag > 0)).to(idx.dtype)  # -0 stored as +0
    return pack_fp4(codes), fp32_to_e8m0(scale)


def dequantize_fp4(packed: torch.Tensor, scale_u8: torch.Tensor, block: int = FP4_BLOCK):
    """packed int8 [..., K/2] + e8m0 bytes [..., K/block] -> fp32 [..., K] (exact)."""
    v = unpack_fp4(packed)
    if scale_u8.shape != v.shape[:-1] + (v.shape[-1] // block,) or v.shape[-1] % block:
        raise ValueError(f"dequantize_fp4: scale shape {tuple(scale_u8.shape)} does not match "
                         f"{tuple(v.shape[:-1])} x {v.shape[-1]}/{block} blocks")
    return (_blocks(v, block) * e8m0_to_fp32(scale_u8)[..., None]).flatten(-2)


def _check_fp8_weight(weight: torch.Tensor, scale: torch.Tensor) -> None:
    if weight.dim() != 2 or weight.dtype != _FP8:
        raise TypeError(f"fp8 weight must be float8_e4m3fn [N, K], got {weight.dtype} "
                        f"{tuple(weight.shape)}")
    n, k = weight.shape
    want = (-(-n // FP8_BLOCK), -(-k // FP8_BLOCK))
    if tuple(scale.shape) != want or scale.dtype != torch.float32:
        raise ValueError(f"fp8 weight scale must be fp32 {want} for weight {(n, k)}, got "
                         f"{scale.dtype} {tuple(scale.shape)}")


def dequantize_fp8_block(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """e4m3 [N, K] times its fp32 scale per 128x128 block [ceil(N/128), ceil(K/128)] -> `dtype`.
    fp32: exact. bf16: exact when every scale is a power of two (the release's ue8m0 scales;
    `scales_are_pow2`), half the bytes; whole blocks take one broadcast multiply, no expanded
    scale tensor."""
    _check_fp8_weight(weight, scale)
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dequantize_fp8_block: dtype must be float32 or bfloat16, got {dtype}")
    n, k = weight.shape
    s = scale.to(dtype)
    if n % FP8_BLOCK == 0 and k % FP8_BLOCK == 0:
        nb, kb = n // FP8_BLOCK, k // FP8_BLOCK
        return (weight.view(nb, FP8_BLOCK, kb, FP8_BLOCK).to(dtype) * s[:, None, :, None]).view(n, k)
    s = s.repeat_interleave(FP8_BLOCK, 0)[:n].repeat_interleave(FP8_BLOCK, 1)[:, :k]
    return weight.to(dtype) * s


def scales_are_pow2(scale: torch.Tensor) -> bool:
    """Whether every fp32 scale is a positive normal power of two (then e4m3 x scale is exact in
    bf16, which keeps fp32's exponent range). Reads the device: call at load, not per step."""
    bits = scale.float().contiguous().view(torch.int32)
    exp = (bits >> 23) & 0xFF
    return bool(((bits & 0x7FFFFF) == 0).all() and (bits >= 0).all() and (exp > 0).all() and (exp < 255).all())


def quantize_fp8_weight(w: torch.Tensor):
    """w [N, K] -> (e4m3 [N, K], fp32 scale [ceil(N/128), ceil(K/128)]): one power-of-two scale
    per 128x128 block (pow2_scale of the block's amax), the release's weight layout; for
    checkpoint writers, dummy weights and tests. dequantize_fp8_block inverts it up to e4m3
    rounding."""
    if w.dim() != 2:
        raise ValueError(f"quantize_fp8_weight: expected a 2-D weight, got {tuple(w.shape)}")
    n, k = w.shape
    nb, kb = -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)
    wp = torch.nn.functional.pad(w.float(), (0, kb * FP8_BLOCK - k, 0, nb * FP8_BLOCK - n))
    blocks = wp.view(nb, FP8_BLOCK, kb, FP8_BLOCK)
    scale = pow2_scale(blocks.abs().amax(dim=(1, 3)), E4M3_MAX)
    q = (blocks / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(_FP8)
    return q.view(nb * FP8_BLOCK, kb * FP8_BLOCK)[:n, :k].contiguous(), scale


def fp8_block_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                         act_quant: bool) -> torch.Tensor:
    """x [..., K] @ W^T -> x.dtype [..., N] with W = dequantize_fp8_block(weight, weight_scale).
    act_quant (release numerics): x is first quantized per 128 along K (quantize_fp8_blocks;
    K % 128 == 0 required), so every product of the two dequantized operands is exact; else x is
    used as given. Accumulation in fp32 either way."""
    _check_fp8_weight(weight, weight_scale)
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"fp8_block_linear: x has K={x.shape[-1]}, weight {tuple(weight.shape)}")
    xf = fp8_round_blocks(x.float()) if act_quant else x.float()
    # Dequantize 128-row slabs at a time: a whole fp32 copy of a large weight is never made.
    out = torch.empty(*x.shape[:-1], weight.shape[0], dtype=torch.float32, device=x.device)
    slab = 8 * FP8_BLOCK
    for n0 in range(0, weight.shape[0], slab):
        w = dequantize_fp8_block(weight[n0:n0 + slab], weight_scale[n0 // FP8_BLOCK:
                                                                    -(-(n0 + slab) // FP8_BLOCK)])
        out[..., n0:n0 + slab] = xf @ w.t()
    return out.to(x.dtype)


def swiglu_clamped(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(gate, L)) * clamp(up, -L, L) in fp32 (no clamp when L <= 0)."""
    gate, up = gate.float(), up.float()
    if limit > 0:
        gate = gate.clamp(max=limit)
        up = up.clamp(-limit, limit)
    return torch.nn.functional.silu(gate) * up


def _check_fp4_experts(w, s, name):
    if w.dim() != 3 or w.dtype not in (torch.int8, torch.uint8):
        raise TypeError(f"{name}: expected packed int8 [E, out, in/2], got {w.dtype} "
                        f"{tuple(w.shape)}")
    want = (w.shape[0], w.shape[1], 2 * w.shape[2] // FP4_BLOCK)
    if (2 * w.shape[2]) % FP4_BLOCK or tuple(s.shape) != want or s.dtype != torch.uint8:
        raise ValueError(f"{name}_scale: expected uint8 e8m0 {want}, got {s.dtype} "
                         f"{tuple(s.shape)}")


def fp4_moe_ref(x, w1, w1_scale, w3, w3_scale, w2, w2_scale, ids, weights, limit: float,
                act_quant: bool) -> torch.Tensor:
    """fp32 [T, d]: out[t] = sum over k with 0 <= ids[t,k] < E_local of
    W2_e(swiglu_clamped(W1_e x, W3_e x, limit) * weights[t,k]), the weighted activation rounded
    to x.dtype before W2 (the semantics of reference.fused_moe; duplicate ids are the caller's
    to mark -1). W* are FP4 experts (packed int8 [E, out, in/2], e8m0 scales [E, out, in/32]).
    act_quant: x and the weighted activation are each rounded to FP8 per 128 before their GEMMs
    (as DeepSeek's reference does for FP4 experts).
    Dense over experts like reference.fused_moe (static shapes, no sync; tiny models/tests)."""
    for w, s, name in ((w1, w1_scale, "w1"), (w3, w3_scale, "w3"), (w2, w2_scale, "w2")):
        _check_fp4_experts(w, s, name)
    T, d = x.shape
    E, inter = w1.shape[0], w1.shape[1]
    if w1.shape != (E, inter, d // 2) or w3.shape != w1.shape or w2.shape != (E, d, inter // 2):
        raise ValueError(f"fp4_moe: w1/w3 {tuple(w1.shape)}/{tuple(w3.shape)}, w2 "
                         f"{tuple(w2.shape)} do not fit x [T, {d}]")
    xf = (fp8_round_blocks(x) if act_quant else x).float()
    acc = torch.zeros(T, d, dtype=torch.float32, device=x.device)
    for e in range(E):
        gate = (weights.float() * (ids == e)).sum(dim=1, keepdim=True)
        g = xf @ dequantize_fp4(w1[e], w1_scale[e]).t()
        u = xf @ dequantize_fp4(w3[e], w3_scale[e]).t()
        h = (swiglu_clamped(g, u, limit) * gate).to(x.dtype)
        if act_quant:
            h = fp8_round_blocks(h)
        acc += h.float() @ dequantize_fp4(w2[e], w2_scale[e]).t()
    return acc
