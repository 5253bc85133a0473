"""Load and write DSV4 checkpoints with the real key names, bf16 or in the release format.

Loading streams: every file is opened with safetensors' lazy `safe_open` (single files and
sharded `model.safetensors.index.json` checkpoints), each tensor's dtype and shape are checked
from its header before it is read, then it is read alone and copied straight into its
(already allocated) parameter on the parameter's device and freed: host RAM holds one tensor
at a time. Routed experts outside the model's expert range (a DP rank's shard) are never read.

Release format (config quantization_config + expert_dtype "fp4"): FP8 e4m3 weights stay e4m3,
their F8_E8M0 (or fp32) block scales become the fp32 `weight_scale`; FP4 experts stay packed
int8 with their e8m0 scale bytes. Nothing is dequantized. Other tensors are cast to their
parameter's dtype (checkpoints mix bf16 weights with fp32 norms, hc_*, ape, attn_sink,
compressor weights and head, and int32/int64 tid2eid). MTP module k (`mtp.{k}.*`) loads into
the model's `mtp[k]` when the model builds it (speculative decoding runs it) and is skipped
otherwise.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from typing import Callable, Dict, Iterable, List, Optional, Tuple

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from sglang.srt.model_loader.key_mapping import checkpoint_to_param, is_stacked_expert, param_to_checkpoint

logger = logging.getLogger(__name__)

_FP8 = torch.float8_e4m3fn
_E8M0 = getattr(torch, "float8_e8m0fnu", None)
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A malformed or mismatched checkpoint; the message names the tensor and what was expected."""


def checkpoint_files(model_dir: str) -> List[str]:
    """The shard files of a sharded checkpoint (from its index), else every *.safetensors."""
    index = os.path.join(model_dir, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: expected a non-empty 'weight_map'")
        files = [os.path.join(model_dir, name) for name in sorted(set(weight_map.values()))]
        for path in files:
            if not os.path.isfile(path):
                raise CheckpointError(f"{index} lists {os.path.basename(path)}, which does not exist")
        return files
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    files = [f for f in files if os.path.basename(f) != "expected.safetensors"]
    if not files:
        raise CheckpointError(f"no *.safetensors files in {model_dir}")
    return files


def _fmt(dtype: str, shape) -> str:
    return f"{dtype} {list(shape)}"


def _convert(key: str, dtype: str, shape: Tuple[int, ...], dst: torch.Tensor, name: str) -> Callable:
    """Checks a tensor's header against its destination; returns how to convert the read
    tensor. Raises CheckpointError naming the tensor and what was expected."""
    want = tuple(dst.shape)
    if dst.dtype == _FP8:  # FP8 linear weight
        if dtype != "F8_E4M3" or shape != want:
            raise CheckpointError(f"{key}: expected an FP8 weight F8_E4M3 {list(want)}, got {_fmt(dtype, shape)}")
        return lambda t: t
    if name.endswith(".weight_scale"):  # FP8 block scales, one per 128x128 block
        if shape != want or dtype not in ("F8_E8M0", "F32"):
            raise CheckpointError(f"{key}: expected the FP8 block scale F8_E8M0 or F32 {list(want)} "
                                  f"(one per 128x128 block of the weight), got {_fmt(dtype, shape)}")
        return _e8m0_to_fp32 if dtype == "F8_E8M0" else (lambda t: t)
    if is_stacked_expert(name) and dst.dtype == torch.int8:  # FP4 expert weight, packed
        if dtype not in ("I8", "U8") or shape != want:
            raise CheckpointError(
                f"{key}: expected an FP4 expert weight I8 {list(want)} (two e2m1 codes per byte: "
                f"[out, in/2] with in = {2 * want[1]}), got {_fmt(dtype, shape)}"
                + (f"; an odd last dim cannot hold packed pairs" if len(shape) == 2 and shape[1] % 2 else ""))
        return lambda t: t.view(torch.int8)
    if is_stacked_expert(name) and dst.dtype == torch.uint8:  # FP4 expert scales, e8m0 bytes
        if shape != want or dtype not in ("F8_E8M0", "U8", "F32"):
            raise CheckpointError(f"{key}: expected the FP4 scale F8_E8M0 {list(want)} (one per 32 inputs), "
                                  f"got {_fmt(dtype, shape)}")
        return _fp32_to_e8m0 if dtype == "F32" else (lambda t: t.view(torch.uint8))
    if dtype in ("F8_E4M3", "F8_E8M0") or (dtype == "I8" and ".experts." in key):
        raise CheckpointError(f"{key}: {dtype} (release format) but the model expects {dst.dtype} {list(want)}: "
                              "config.json needs the release's quantization_config and expert_dtype \"fp4\"")
    if shape != want:
        raise CheckpointError(f"{key}: shape {list(shape)} in checkpoint, {list(want)} in model")
    return lambda t: t


def _e8m0_to_fp32(t: torch.Tensor) -> torch.Tensor:
    from dsv4_kernels.quant_reference import e8m0_to_fp32

    return e8m0_to_fp32(t.view(torch.uint8))


def _fp32_to_e8m0(t: torch.Tensor) -> torch.Tensor:
    from dsv4_kernels.quant_reference import fp32_to_e8m0

    return fp32_to_e8m0(t)


def model_tensors(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    params: Dict[str, torch.Tensor] = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    return params


def _mtp_module(key: str) -> int:
    index = key.split(".", 2)[1]
    if not index.isdigit():
        raise CheckpointError(f"unexpected checkpoint tensor {key} (MTP tensors are named mtp.<module>.*)")
    return int(index)


def _first_expert(model: torch.nn.Module, name: str) -> int:
    return model.get_submodule(name.rsplit(".", 1)[0]).first_expert


@torch.no_grad()
def load_checkpoint(model: torch.nn.Module, model_dir: str,
                    on_tensor: Optional[Callable[[str, torch.Tensor], None]] = None) -> None:
    """Stream `model_dir` into `model`'s parameters (see the module docstring). on_tensor:
    called with each tensor as read, before it is copied and freed (memory tests)."""
    params = model_tensors(model)
    loaded, skipped_mtp, skipped_experts = set(), 0, 0
    mtp_modules = len(getattr(model, "mtp", ()))
    for path in checkpoint_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                if key.startswith("mtp.") and _mtp_module(key) >= mtp_modules:
                    skipped_mtp += 1  # a module this run does not build (ServerArgs.run_config)
                    continue
                name, expert = checkpoint_to_param(key)
                if name not in params:
                    if name.endswith("_scale") and name.removesuffix("_scale") in params:  # its weight's name
                        raise CheckpointError(f"{key}: a quantization scale, but the model's weight is not quantized: "
                                              "config.json needs the release's quantization_config and "
                                              "expert_dtype \"fp4\"")
                    raise CheckpointError(f"unexpected checkpoint tensor {key} (no parameter {name})")
                dst = params[name]
                if expert is not None:
                    local = expert - _first_expert(model, name)
                    if not 0 <= local < dst.shape[0]:
                        skipped_experts += 1  # another rank's expert: never read
                        continue
                    dst = dst[local]
                header = f.get_slice(key)
                convert = _convert(key, header.get_dtype(), tuple(header.get_shape()), dst, name)
                t = f.get_tensor(key)
                if on_tensor is not None:
                    on_tensor(key, t)
                dst.copy_(convert(t).to(dst.dtype) if dst.dtype not in (_FP8, torch.int8, torch.uint8)
                          else convert(t))
                del t
                loaded.add(name if expert is None else f"{name}.{expert}")
    _check_complete(model, params, loaded, model_dir)
    if skipped_mtp:
        logger.info("skipped %d tensors of MTP modules this run does not use (speculative decoding off, or "
                    "fewer --speculative-num-steps than modules)", skipped_mtp)
    if skipped_experts:
        logger.info("skipped %d routed-expert tensors held by other ranks", skipped_experts)


def _check_complete(model, params, loaded, model_dir) -> None:
    missing = []
    for name, p in params.items():
        if is_stacked_expert(name):
            first = _first_expert(model, name)
            missing += [(name, e) for e in range(first, first + p.shape[0]) if f"{name}.{e}" not in loaded]
        elif name not in loaded:
            missing.append((name, None))
    if not missing:
        return
    scales = [(n, e) for n, e in missing if n.endswith(("weight_scale", "_scale"))]
    if scales and len(scales) == len(missing):  # a quantized weight came without its scale
        n, e = scales[0]
        key = param_to_checkpoint(n, e)
        weight = key[: -len(".scale")] + ".weight"
        raise CheckpointError(f"{key} is missing: the quantized weight {weight} needs its scale "
                              f"{list(params[n].shape[1 if e is not None else 0:])} ({len(scales)} scale(s) missing)")
    shown = ", ".join(param_to_checkpoint(n, e) for n, e in missing[:8])
    raise CheckpointError(f"{len(missing)} tensors missing from {model_dir}: {shown}{' ...' if len(missing) > 8 else ''}")


# ---- writer --------------------------------------------------------------------------------

# Tensors the release stores in fp32 (everything else is bf16 unless quantised).
_FP32_MARKERS = ("norm.weight", "attn_sink", ".ape", "compressor.", "hc_", "head.weight", "gate.bias")


def _ckpt_dtype(key: str) -> torch.dtype:
    if key.endswith("tid2eid"):
        return torch.int32
    if key == "head.weight" or any(m in key for m in _FP32_MARKERS):
        return torch.float32
    return torch.bfloat16


def _checkpoint_items(model: torch.nn.Module, config) -> Iterable[Tuple[str, torch.Tensor]]:
    """(checkpoint key, tensor in its checkpoint dtype), one at a time, from the model as it is
    stored: quantized parameters are written as they are held (FP8 scales as F8_E8M0 bytes
    when the config says ue8m0), never dequantized."""
    ue8m0 = getattr(config, "fp8_scale_fmt", None) == "ue8m0"
    for name, p in model_tensors(model).items():
        if is_stacked_expert(name):
            first = _first_expert(model, name)
            items = ((param_to_checkpoint(name, first + e), p[e]) for e in range(p.shape[0]))
        else:
            items = ((param_to_checkpoint(name), p),)
        for key, t in items:
            t = t.detach()
            if t.dtype in (_FP8, torch.int8):
                out = t
            elif t.dtype == torch.uint8:  # FP4 expert scales: e8m0 bytes
                out = t.view(_E8M0)
            elif name.endswith(".weight_scale"):
                out = _fp32_to_e8m0(t).view(_E8M0) if ue8m0 else t.float()
            else:
                out = t.to(_ckpt_dtype(key))
            yield key, out.cpu().contiguous()


def save_checkpoint(model: torch.nn.Module, config, out_dir: str, max_shard_bytes: Optional[int] = None) -> None:
    """Write `model` as a DSV4 checkpoint directory: config.json + model.safetensors, or with
    max_shard_bytes, model-0000i-of-0000n.safetensors shards + model.safetensors.index.json.
    A release-format model (FP8 linears, FP4 experts) is written in the release format with
    its quantization_config and expert_dtype; a bf16 model as bf16."""
    os.makedirs(out_dir, exist_ok=True)
    shards: List[Dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, t in _checkpoint_items(model, config):
        nbytes = t.numel() * t.element_size()
        if max_shard_bytes and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = t
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], os.path.join(out_dir, "model.safetensors"))
    else:
        weight_map, total = {}, 0
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(out_dir, fname))
            for key, t in shard.items():
                weight_map[key] = fname
                total += t.numel() * t.element_size()
        with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config.to_dict(), f, indent=1)
