"""Who multiplies the FP4 routed experts: one module per backend behind one small interface
(base.Fp4MoEBackend), picked once per model by `--moe-backend` (resolve_moe_backend) and
attached after the weights are loaded (DeepseekV4ForCausalLM.use_moe_backend).

- "torch": quant_reference.fp4_moe_ref, dense over experts (CPU, tests, tiny models).
- "triton": sgl-kernel's Triton FP4 MoE (dsv4_kernels.ops.fp4_fused_moe; the reference on CPU).
- "humming": humming-kernels' indexed W4A8 / W4A16 GEMMs on Hopper and newer, with our routing
  alignment, activation rounding and SwiGLU step around them (humming_moe.py).

"auto" is humming on a CUDA GPU of compute capability 9.0 or more when `humming` imports and
the model runs in bf16 / fp16, Triton on other CUDA setups with segment kernels, the torch
reference elsewhere.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from sglang.srt.layers.moe.backends.base import Fp4MoEBackend

BACKEND_NAMES = ("torch", "triton", "humming")  # what "auto" resolves among
HUMMING_DTYPES = (torch.bfloat16, torch.float16)


@functools.lru_cache(maxsize=None)
def humming_import_error() -> str | None:
    """None when humming-kernels imports, else why not (the message a user needs)."""
    if importlib.util.find_spec("humming") is None:
        return "humming-kernels is not installed (pip install 'sglang-dsv4[humming]')"
    try:
        importlib.import_module("humming.layer")
    except Exception as e:  # a broken install reads the same to the user: it cannot run
        return f"humming-kernels does not import: {type(e).__name__}: {e}"
    return None


def humming_unsupported(device, dtype: torch.dtype) -> str | None:
    """None when the humming backend can run this model here, else the reason."""
    if torch.device(device).type != "cuda":
        return "humming runs on CUDA GPUs only"
    if dtype not in HUMMING_DTYPES:
        return f"humming multiplies bf16 / fp16 activations; this model runs in {dtype}"
    reason = humming_import_error()
    if reason is not None:
        return reason
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    major, _ = torch.cuda.get_device_capability(torch.device(device))
    if major < 9:
        return f"humming's FP4 MoE path here is for compute capability 9.0+, this GPU is {major}.x"
    return None


def resolve_moe_backend(requested: str, device, dtype: torch.dtype, segment_kernels: bool,
                        fp4_experts: bool = True) -> str:
    """The concrete backend for `--moe-backend requested` ("auto" resolved); raises ValueError
    naming the reason when an explicit choice cannot run here. The backends run FP4 experts
    (release-format checkpoints); bf16 experts follow --segment-kernels, so for them only
    "auto" is accepted (resolved to what they run: triton with segment kernels, else torch)."""
    if requested not in ("auto",) + BACKEND_NAMES:
        raise ValueError(f"--moe-backend must be one of auto, {', '.join(BACKEND_NAMES)}, got {requested!r}")
    on_cuda = torch.device(device).type == "cuda"
    if not fp4_experts and requested != "auto":
        raise ValueError(f"--moe-backend {requested}: the MoE backends run FP4 (release-format) experts and this "
                         "model's experts are bf16 (they follow --segment-kernels); leave --moe-backend at auto")
    if not fp4_experts:
        return "triton" if on_cuda and segment_kernels else "torch"
    if requested == "auto":
        if on_cuda and segment_kernels and humming_unsupported(device, dtype) is None:
            return "humming"
        return "triton" if on_cuda and segment_kernels else "torch"
    if requested == "humming":
        reason = humming_unsupported(device, dtype)
        if reason is not None:
            raise ValueError(f"--moe-backend humming: {reason}")
    if requested == "triton" and not on_cuda:
        raise ValueError("--moe-backend triton needs a CUDA device (use torch on CPU)")
    return requested


def make_fp4_backend(name: str) -> Fp4MoEBackend:
    """The backend object for a resolved name (imports only what that backend needs)."""
    if name == "torch":
        from sglang.srt.layers.moe.backends.reference import ReferenceFp4MoE

        return ReferenceFp4MoE()
    if name == "triton":
        from sglang.srt.layers.moe.backends.triton_moe import TritonFp4MoE

        return TritonFp4MoE()
    if name == "humming":
        from sglang.srt.layers.moe.backends.humming_moe import HummingFp4MoE

        return HummingFp4MoE()
    raise ValueError(f"no FP4 MoE backend {name!r} (resolved names: torch, triton, humming)")


__all__ = ["BACKEND_NAMES", "Fp4MoEBackend", "humming_import_error", "humming_unsupported",
           "make_fp4_backend", "resolve_moe_backend"]
