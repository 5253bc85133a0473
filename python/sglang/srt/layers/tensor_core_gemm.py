"""fp32-accurate GEMMs on bf16 tensor cores, for the products the model runs in fp32.

Two cases, both only for bf16 models on CUDA (fp32 models and CPU keep the fp32 GEMMs):
- both operands exact in bf16 (a bf16 activation times a bf16 or dequantized-FP8 weight):
  the same products, accumulated in fp32 by cuBLAS with an fp32 output (`out_dtype`), so only
  the summation order differs from the fp32 GEMM (no bf16 split-K partials, whatever
  `allow_bf16_reduced_precision_reduction` says: those apply to bf16 outputs only);
- an fp32 weight times a bf16-exact activation: the weight split once into bf16 terms,
  w_hi = bf16(w), w_lo = bf16(w - w_hi) (|w - w_hi - w_lo| <= 2^-16 |w|) and optionally a
  third (three terms hold the fp32 weight exactly), applied as ONE GEMM along a repeated K:
  [x, x, x] @ [w_hi, w_lo, w_lo2]^T, fp32 accumulation and output.
H200: fp32 GEMMs run at ~60 TFLOP/s, bf16 tensor cores at ~990.
"""

from __future__ import annotations

import functools
import logging
from typing import Sequence

import torch

logger = logging.getLogger(__name__)


def tensor_core_eligible(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a model of `dtype` on `device` takes the tensor-core path: bf16 on CUDA only
    (fp16's narrow exponent would flush small w_lo terms; fp32 models keep exact fp32), where
    torch has the fp32-output GEMMs. Called after load, never per step."""
    device = torch.device(device)
    return dtype == torch.bfloat16 and device.type == "cuda" and _fp32_output_gemms(device)


@functools.lru_cache(maxsize=None)
def _fp32_output_gemms(device: torch.device) -> bool:
    """torch.mm / bmm with out_dtype=float32 on bf16 CUDA inputs (torch >= 2.8), tried once."""
    try:
        a = torch.ones(1, 1, 1, dtype=torch.bfloat16, device=device)
        ok = torch.bmm(a, a, out_dtype=torch.float32).dtype == torch.float32 and \
            torch.mm(a[0], a[0], out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError, NotImplementedError, AssertionError) as e:  # Assertion: no CUDA build
        logger.warning("bf16 GEMMs with an fp32 output are not available (%s): the fp32 GEMMs stay", e)
        return False
    return ok


def _check_16bit_pair(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if a.dtype != b.dtype or a.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"{what}: operands must share a bf16/fp16 dtype, got {a.dtype} and {b.dtype}")


def mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b [K, N] -> fp32 [M, N]: exact products of the 16-bit operands accumulated in
    fp32. CUDA: one cuBLAS GEMM with an fp32 output; elsewhere the fp32 GEMM of the upcast
    operands (the same products: what the CPU tests check the split against)."""
    _check_16bit_pair(a, b, "mm_fp32")
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


def bmm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [B, M, K] @ b [B, K, N] -> fp32 [B, M, N], as mm_fp32 per batch (strided views are
    taken as they are: no copy for transposed operands)."""
    _check_16bit_pair(a, b, "bmm_fp32")
    if a.is_cuda:
        return torch.bmm(a, b, out_dtype=torch.float32)
    return torch.bmm(a.float(), b.float())


def split_rel_error(terms: int) -> float:
    """Relative error bound of a `terms`-term bf16 split per weight element: bf16 keeps 8
    significant bits, and each term rounds what the previous ones left (3 terms hold the 24 bits
    of an fp32 significand: exact but for underflow below bf16's smallest normal)."""
    return 2.0 ** (-8 * terms)


def split_bf16(w: torch.Tensor, terms: int = 2) -> list[torch.Tensor]:
    """fp32 w -> `terms` bf16 tensors whose sum is w within split_rel_error(terms) * |w|."""
    if w.dtype != torch.float32:
        raise TypeError(f"split_bf16: expected an fp32 weight, got {w.dtype}")
    if terms not in (2, 3):
        raise ValueError(f"split_bf16: terms must be 2 or 3, got {terms}")
    parts, rest = [], w
    for _ in range(terms):
        parts.append(rest.to(torch.bfloat16))
        rest = rest - parts[-1].float()  # exact in fp32: the term is within 2x of the rest (Sterbenz)
    return parts


def split_weight(weights: Sequence[torch.Tensor], terms: int = 2) -> torch.Tensor:
    """fp32 [N_i, K] weights that share an input -> one bf16 [sum N_i, terms * K] operand
    [w_hi | w_lo (| w_lo2)] for `split_linear` (2 terms: the bytes of the fp32 weights)."""
    w = torch.cat([t.detach() for t in weights], dim=0) if len(weights) > 1 else weights[0].detach()
    if w.dim() != 2:
        raise ValueError(f"split_weight: expected 2-D [N, K] weights, got {tuple(w.shape)}")
    return torch.cat(split_bf16(w, terms), dim=1).contiguous()


def merge_split(w_split: torch.Tensor, terms: int) -> torch.Tensor:
    """The fp32 weight back from `split_weight`'s operand, the terms summed in their order:
    exact for 3 terms (every partial sum is on the weight's own ulp grid)."""
    parts = w_split.chunk(terms, dim=1)
    w = parts[0].float()
    for p in parts[1:]:
        w = w + p.float()
    return w


def split_linear(x: torch.Tensor, w_split: torch.Tensor) -> torch.Tensor:
    """x [M, K] (bf16) @ a split fp32 weight [N, terms * K] -> fp32 [M, N] ~= x.float() @ w.T:
    one GEMM over the repeated K ([x, x, ...] @ [w_hi, w_lo, ...]^T) accumulating every term
    in fp32."""
    if x.dtype != torch.bfloat16 or w_split.dtype != torch.bfloat16:
        raise TypeError(f"split_linear: expected bf16 x and split weight, got {x.dtype} and {w_split.dtype}")
    k, kk = x.shape[-1], w_split.shape[-1]
    if kk % k or kk // k not in (2, 3):
        raise ValueError(f"split_linear: x has K={k}, the split weight {kk} (2K or 3K expected)")
    return mm_fp32(torch.cat([x] * (kk // k), dim=-1), w_split.t())


def grouped_bf16_einsum(o: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """einsum("tgd,grd->tgr") of bf16 o [T, G, D] and w [G, R, D] with fp32 accumulation, the
    result rounded once to o's dtype ([T, G, R], contiguous): the fp32 einsum's products."""
    out = bmm_fp32(o.transpose(0, 1), w.transpose(1, 2))  # [G, T, R] fp32
    return out.transpose(0, 1).to(o.dtype, memory_format=torch.contiguous_format)
