"""FP8 block-scaled linear through cuBLAS: torch's scaled GEMM with DeepSeek's block scales
(activations 1 x 128, weights 128 x 128; cuBLASLt >= 12.9 on sm90). fp8_gemm.fp8_block_linear
takes it for release numerics on bf16/fp16 activations when the device passed the probe below;
everything else (weight-only, fp32 x, CPU, shapes cuBLAS refuses) stays on the Triton kernels.
Measured on an H200 (sgl-kernel/benchmark/probe_torch_gemm.py): 1.5-2.6x the Triton GEMM at M = 64..16384
with the same error against the fp32 product (M <= 16 is not measured yet).

Layout contract of cuBLASLt for a [M, K] (e4m3, row-major) times b = weight.t() [K, N]
(PyTorch PR 166752 states it; L = K/128, L4 = L rounded up to a multiple of 4):
- scale_a [M, L], strides (1, M): fp8_act_quant.quantize_act's scales as they are;
- scale_b [L4, N/128], strides (1, L4): the weight's [N/128, L] scales transposed, each row of
  them padded with zeros to L4 (pad blocks multiply nothing: K ends at L). With L % 4 == 0 that
  is weight_scale.t() itself, which torch._scaled_mm takes (the layout timed on the H200).
  Otherwise the padded copy goes through torch.nn.functional.scaled_mm (explicit recipes, which
  checks the L4 shape); torch._scaled_mm insists on the unpadded stride L, with which cuBLAS
  read wrong scales silently (the bug that PR fixed).
- M is padded to a multiple of 4 (quantize_act writes zero rows; the result is sliced). torch
  does not check M, but the 1 x 128 scale tensor's leading dimension is M and cuBLAS wants 16-byte
  aligned scale columns (vLLM pads M to 4 for it); at most 3 zero rows.
- N and K whole 128-blocks, a contiguous 16-byte aligned weight: anything else stays on Triton.

Support is decided once per (device, output dtype, padded or not) by `device_supports`: a
tiny GEMM with exact operands and power-of-two scales that vary per block, compared with the
float64 product (a misread scale layout is off by powers of two, so wrong answers fail it, not
only exceptions). The probe syncs, so it never runs while the current stream captures: an
undecided call under capture takes Triton (graph runners warm up eagerly first, which decides).

Graph-safe: the call is quantize_act + one cuBLAS GEMM + a row slice; no host syncs, shapes
depend only on M, N, K.
"""

from __future__ import annotations

import logging

import torch

from .fp8_act_quant import quantize_act

logger = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
BLOCK = 128
BACKENDS = ("auto", "triton", "cublas")

_SUPPORT: dict[tuple, bool] = {}  # (device type, index, out dtype, padded) -> probe passed
_FAILURES: dict[tuple, str] = {}  # the same keys -> why the probe failed


def round_up(v: int, multiple: int) -> int:
    return -(-v // multiple) * multiple


def weight_scale_layout(weight_scale: torch.Tensor) -> torch.Tensor:
    """fp32 [N/128, L] block scales -> cuBLAS's scale_b: [L4, N/128] with strides (1, L4),
    L4 = round_up(L, 4), the pad zeros. A view of weight_scale when L % 4 == 0 and it is
    contiguous fp32 (the common case: nothing to cache); else a new tensor, which callers
    build once (Fp8BlockLinear keeps it), not per step."""
    if weight_scale.dim() != 2:
        raise ValueError(f"weight_scale_layout: expected [N/128, K/128] scales, got "
                         f"{tuple(weight_scale.shape)}")
    nb, L = weight_scale.shape
    L4 = round_up(L, 4)
    if L4 == L and weight_scale.dtype == torch.float32 and weight_scale.is_contiguous():
        return weight_scale.t()
    padded = torch.zeros(nb, L4, dtype=torch.float32, device=weight_scale.device)
    padded[:, :L] = weight_scale
    return padded.t()


def refusal(x: torch.Tensor, weight: torch.Tensor, act_quant: bool) -> str | None:
    """Why this call cannot go through cuBLAS (a sentence naming what), or None when its
    numerics, dtypes, shape, layout and device fit (the per-device probe is separate)."""
    if not act_quant:
        return "weight-only numerics (cuBLAS multiplies FP8-quantized activations)"
    if x.dtype not in (torch.bfloat16, torch.float16):
        return f"x is {x.dtype} (bf16/fp16 only; fp32 takes the exact fp32 kernel)"
    N, K = weight.shape
    if N % BLOCK or K % BLOCK:
        return f"weight {N} x {K} is not whole 128 x 128 blocks"
    if weight.dtype != FP8 or not weight.is_contiguous() or weight.data_ptr() % 16:
        return "weight is not a contiguous, 16-byte aligned float8_e4m3fn tensor"
    if x.device.type != "cuda":
        return f"x is on {x.device.type}, not CUDA"
    return None


def block_scaled_mm(q: torch.Tensor, s: torch.Tensor, weight: torch.Tensor,
                    scale_b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """q e4m3 [M, K] with scales s [M, K/128] (strides (1, M)) times weight e4m3 [N, K] with
    scale_b = weight_scale_layout(...) -> out_dtype [M, N]. The one place torch is called."""
    if scale_b.shape[0] == s.shape[1]:  # L % 4 == 0: the unpadded layout torch._scaled_mm checks
        return torch._scaled_mm(q, weight.t(), scale_a=s, scale_b=scale_b, out_dtype=out_dtype)
    F = torch.nn.functional
    return F.scaled_mm(q, weight.t(), s, F.ScalingType.BlockWise1x128, scale_b,
                       F.ScalingType.BlockWise128x128, output_dtype=out_dtype)


def block_linear(x2: torch.Tensor, weight: torch.Tensor, scale_b: torch.Tensor) -> torch.Tensor:
    """x [M, K] bf16/fp16 -> x.dtype [M, N] = quantize_act(x) @ dequant(weight)^T on cuBLAS.
    scale_b: weight_scale_layout(weight_scale), checked against the contract here."""
    M, K = x2.shape
    N = weight.shape[0]
    L = K // BLOCK
    rows_b, nb = scale_b.shape if scale_b.dim() == 2 else (-1, -1)
    if (scale_b.dtype != torch.float32 or nb != N // BLOCK or rows_b not in (L, round_up(L, 4))
            or (rows_b > 1 and scale_b.stride(0) != 1) or (nb > 1 and scale_b.stride(1) != rows_b)):
        raise ValueError(f"fp8_block_linear: cublas_scale must be weight_scale_layout's fp32 "
                         f"[{round_up(L, 4)}, {N // BLOCK}] (strides (1, L4)), got {scale_b.dtype} "
                         f"{tuple(scale_b.shape)} strides {scale_b.stride()}")
    rows = round_up(M, 4)
    q, s = quantize_act(x2, rows=rows)
    y = block_scaled_mm(q, s, weight, scale_b, x2.dtype)
    return y if rows == M else y[:M]


def _probe(device: torch.device, out_dtype: torch.dtype, padded: bool) -> str | None:
    """Run one tiny block-scaled GEMM on `device` and compare it with the float64 product:
    None if it agrees, else the reason. Operands are small integers (exact in e4m3) with
    power-of-two scales of 2^-6..1 that differ per block, so a misread scale is off by a
    power of two (|result| <= 512 * 16: fp16 holds it); tolerance: the output dtype's
    rounding plus a reduced-precision accumulation, both far below that."""
    M, N, K = 4, 2 * BLOCK, (3 if padded else 4) * BLOCK
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-4, 5, (M, K), generator=g).double()
    w = torch.randint(-4, 5, (N, K), generator=g).double()
    sa = 2.0 ** torch.randint(-6, 1, (M, K // BLOCK), generator=g).double()
    sw = 2.0 ** torch.randint(-6, 1, (N // BLOCK, K // BLOCK), generator=g).double()
    a_deq = a * sa.repeat_interleave(BLOCK, 1)
    w_deq = w * sw.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)
    ref = a_deq @ w_deq.t()
    bound = a_deq.abs() @ w_deq.abs().t()
    try:
        q = a.to(device=device, dtype=torch.float32).to(FP8)
        s = torch.empty(K // BLOCK, M, device=device).t().copy_(sa)  # strides (1, M)
        wq = w.to(device=device, dtype=torch.float32).to(FP8)
        scale_b = weight_scale_layout(sw.to(device=device, dtype=torch.float32))
        got = block_scaled_mm(q, s, wq, scale_b, out_dtype).double().cpu()
    except Exception as exc:  # a probe: any refusal means "use Triton", with the reason kept
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    err = (got - ref).abs()
    tol = 2.0 ** -7 * ref.abs() + 2.0 ** -10 * bound
    if not bool((err <= tol).all()):
        return (f"wrong result (max |error| {err.max().item():.3g}, over tolerance by up to "
                f"{(err / tol).max().item():.3g}x)")
    return None


def _key(device: torch.device, out_dtype: torch.dtype, padded: bool) -> tuple:
    device = torch.device(device)
    index = device.index
    if index is None:
        index = torch.cuda.current_device() if device.type == "cuda" else -1
    return device.type, index, out_dtype, padded


def device_supports(device: torch.device, out_dtype: torch.dtype, padded: bool) -> bool | None:
    """Whether cuBLAS block scaling gives right answers here, probed once per (device, output
    dtype, padded scale layout or not) and cached; None while undecided under graph capture."""
    key = _key(device, out_dtype, padded)
    if key not in _SUPPORT:
        if key[0] == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        why = _probe(torch.device(key[0], key[1]) if key[1] >= 0 else torch.device(key[0]),
                     out_dtype, padded)
        _SUPPORT[key] = why is None
        layout = "zero-padded" if padded else "unpadded"
        if why is None:
            logger.info("FP8 block linears on %s:%d (%s out, %s weight scales): cuBLAS",
                        key[0], key[1], out_dtype, layout)
        else:
            _FAILURES[key] = why
            logger.warning("FP8 block linears on %s:%d (%s out, %s weight scales) stay on "
                           "Triton: the cuBLAS probe failed (%s)", key[0], key[1], out_dtype,
                           layout, why)
    return _SUPPORT[key]


def probe_failures() -> dict[tuple, str]:
    """(device type, index, out dtype, padded) -> why the probe refused it (for logs, benches)."""
    return dict(_FAILURES)


def use_cublas(x: torch.Tensor, weight: torch.Tensor, act_quant: bool, backend: str) -> bool:
    """The dispatch: "triton" never; "auto" when `refusal` is None and the device probe passed
    (undecided under capture: no); "cublas" whenever it can run (undecided under capture: yes,
    the caller forced it), else ValueError with the reason."""
    if backend not in BACKENDS:
        raise ValueError(f"fp8_block_linear: backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "triton":
        return False
    why = refusal(x, weight, act_quant)
    if why is None:
        padded = (weight.shape[1] // BLOCK) % 4 != 0
        ok = device_supports(x.device, x.dtype, padded)
        if ok or (ok is None and backend == "cublas"):
            return True
        if ok is None:
            return False
        why = ("this torch / GPU failed the cuBLAS block-scaling probe: "
               + _FAILURES[_key(x.device, x.dtype, padded)])
    if backend == "cublas":
        raise ValueError(f"fp8_block_linear: backend='cublas' cannot run this call: {why}")
    return False
