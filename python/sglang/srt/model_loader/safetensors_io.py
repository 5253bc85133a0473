"""Load and write DSV4 checkpoints with the real key names.

Loading casts every tensor to its parameter's dtype (checkpoints mix bf16 weights with
fp32 norms, hc_*, ape, attn_sink, compressor weights and head, and int32 tid2eid).
FP8 e4m3 weights with a block scale (`<name>.scale`, blocks from quantization_config,
default 128x128) are dequantised on load. FP4 experts are not supported (clear error).
MTP layers (`mtp.*`) load into the model's `mtp` modules when the config declares them
(num_nextn_predict_layers); they are not run (speculative decoding is out of scope), and
are skipped when the model has none.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from typing import Dict, Iterable, Optional, Tuple

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from sglang.srt.model_loader.key_mapping import checkpoint_to_param, is_stacked_expert, param_to_checkpoint

logger = logging.getLogger(__name__)

_FP8 = getattr(torch, "float8_e4m3fn", None)
_SCALE_SUFFIXES = (".scale", ".weight_scale_inv")


class CheckpointError(ValueError):
    pass


def _iter_tensors(model_dir: str) -> Iterable[Tuple[str, torch.Tensor]]:
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    files = [f for f in files if os.path.basename(f) != "expected.safetensors"]
    if not files:
        raise CheckpointError(f"no *.safetensors files in {model_dir}")
    for path in files:
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, block: Tuple[int, int]) -> torch.Tensor:
    bo, bi = block
    s = scale.float().repeat_interleave(bo, 0)[: weight.shape[0]]
    s = s.repeat_interleave(bi, 1)[:, : weight.shape[1]]
    return weight.float() * s


def load_checkpoint(model: torch.nn.Module, model_dir: str, fp8_block: Optional[Tuple[int, int]] = None) -> None:
    params: Dict[str, torch.Tensor] = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    tensors = dict(_iter_tensors(model_dir))
    loaded, skipped_mtp = set(), 0
    has_mtp = any(name.startswith("mtp.") for name in params)
    for key, t in tensors.items():
        if key.endswith(_SCALE_SUFFIXES):
            continue
        if key.startswith("mtp.") and not has_mtp:
            skipped_mtp += 1
            continue
        if str(t.dtype).startswith("torch.float4") or (t.dtype in (torch.int8, torch.uint8) and ".experts." in key):
            raise NotImplementedError(f"{key}: FP4 expert weights are not supported; use a bf16 or fp8 checkpoint")
        if _FP8 is not None and t.dtype == _FP8:
            base = key[: -len(".weight")]
            scale = next((tensors[base + s] for s in _SCALE_SUFFIXES if base + s in tensors), None)
            if scale is None:
                raise CheckpointError(f"{key}: fp8 weight without a block scale ({base}.scale)")
            t = dequantize_fp8(t, scale, fp8_block or (128, 128))
        name, expert = checkpoint_to_param(key)
        if name not in params:
            raise CheckpointError(f"unexpected checkpoint tensor {key} (no parameter {name})")
        dst = params[name] if expert is None else params[name][expert]
        if tuple(dst.shape) != tuple(t.shape):
            raise CheckpointError(f"{key}: shape {tuple(t.shape)} in checkpoint, {tuple(dst.shape)} in model")
        with torch.no_grad():
            dst.copy_(t.to(dst.dtype))
        loaded.add(name if expert is None else f"{name}.{expert}")
    missing = []
    for name, p in params.items():
        if is_stacked_expert(name):
            missing += [f"{name}.{e}" for e in range(p.shape[0]) if f"{name}.{e}" not in loaded]
        elif name not in loaded:
            missing.append(name)
    if missing:
        shown = ", ".join(param_to_checkpoint(*_split_expert(m)) for m in missing[:8])
        raise CheckpointError(f"{len(missing)} tensors missing from {model_dir}: {shown}{' ...' if len(missing) > 8 else ''}")
    if skipped_mtp:
        logger.info("skipped %d MTP tensors (speculative decoding is not supported)", skipped_mtp)


def _split_expert(name: str) -> Tuple[str, Optional[int]]:
    head, _, tail = name.rpartition(".")
    if tail.isdigit() and is_stacked_expert(head):
        return head, int(tail)
    return name, None


# Tensors the release stores in fp32 (everything else is bf16 unless quantised).
_FP32_MARKERS = ("norm.weight", "attn_sink", ".ape", "compressor.", "hc_", "head.weight", "gate.bias")


def _ckpt_dtype(key: str) -> torch.dtype:
    if key.endswith("tid2eid"):
        return torch.int32
    if key == "head.weight" or any(m in key for m in _FP32_MARKERS):
        return torch.float32
    return torch.bfloat16


def _quantize_fp8(w: torch.Tensor, block: int = 128) -> Tuple[torch.Tensor, torch.Tensor]:
    o, i = w.shape
    bo, bi = -(-o // block), -(-i // block)
    padded = torch.zeros(bo * block, bi * block)
    padded[:o, :i] = w.float()
    blocks = padded.view(bo, block, bi, block)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale = amax / 448.0
    q = (blocks / scale[:, None, :, None]).view(bo * block, bi * block)[:o, :i].to(_FP8)
    return q, scale.float()


def save_checkpoint(model: torch.nn.Module, config, out_dir: str, fp8_linear: bool = False) -> None:
    """Write `model` as a DSV4 checkpoint directory: config.json + model.safetensors.
    With fp8_linear, 2-D bf16 projection weights are stored as fp8 e4m3 + 128x128 scales."""
    os.makedirs(out_dir, exist_ok=True)
    out: Dict[str, torch.Tensor] = {}
    named = dict(model.named_parameters())
    named.update(dict(model.named_buffers()))
    for name, p in named.items():
        items = [(param_to_checkpoint(name, e), p[e]) for e in range(p.shape[0])] if is_stacked_expert(name) \
            else [(param_to_checkpoint(name), p)]
        for key, t in items:
            dtype = _ckpt_dtype(key)
            t = t.detach().cpu().to(dtype).contiguous()
            if fp8_linear and dtype == torch.bfloat16 and t.dim() == 2 and key.endswith(".weight") and key != "embed.weight":
                q, s = _quantize_fp8(t)
                out[key], out[key[: -len(".weight")] + ".scale"] = q, s
            else:
                out[key] = t
    save_file(out, os.path.join(out_dir, "model.safetensors"))
    cfg = config.to_dict()
    if fp8_linear:
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
