"""Seeded random weights for the presets, scaled so activations stay O(1) through the mHC
residual streams and logits are finite and not degenerate at every preset."""

from __future__ import annotations

import math
import zlib

import torch
from torch import nn


def _tensor_generator(seed: int, name: str, device: torch.device, index: int = 0) -> torch.Generator:
    """A generator of its own per quantized tensor (and expert), on the tensor's device: each
    rank draws exactly its shard, the same values whatever the sharding, without a host copy."""
    return torch.Generator(device=device).manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) * 4099 + index)


def _std(name: str, fan_in: int, out_scale: float) -> float:
    # Residual-branch outputs (wo_b, expert/shared w2) shrink with depth, as trained models' do.
    down = name.endswith(("wo_b.weight", "w2.weight", "experts.w2"))
    return (out_scale if down else 1.0) / math.sqrt(fan_in)


@torch.no_grad()
def _init_fp8_linear(name: str, weight: torch.Tensor, scale: torch.Tensor, seed: int, out_scale: float) -> None:
    """N(0, std) drawn in fp32 on the weight's device, 128-row slabs at a time, quantized the
    release's way (quantize_fp8_weight): no bf16/fp32 master of the whole weight."""
    from dsv4_kernels.quant_reference import FP8_BLOCK, quantize_fp8_weight

    g = _tensor_generator(seed, name, weight.device)
    std = _std(name, weight.shape[1], out_scale)
    slab = 8 * FP8_BLOCK
    for r0 in range(0, weight.shape[0], slab):
        rows = weight[r0:r0 + slab]
        q, s = quantize_fp8_weight(torch.randn(rows.shape, generator=g, device=weight.device) * std)
        rows.copy_(q)
        scale[r0 // FP8_BLOCK:r0 // FP8_BLOCK + s.shape[0]].copy_(s)


@torch.no_grad()
def _init_fp4_experts(name: str, packed: torch.Tensor, scale: torch.Tensor, first_expert: int, seed: int,
                      out_scale: float) -> None:
    """Each local expert drawn in fp32 on the device from its own generator, quantized to FP4."""
    from dsv4_kernels.quant_reference import quantize_fp4

    fan_in = packed.shape[2] * 2
    std = _std(name, fan_in, out_scale)
    for e in range(packed.shape[0]):
        g = _tensor_generator(seed, name, packed.device, first_expert + e)
        q, s = quantize_fp4(torch.randn(packed.shape[1], fan_in, generator=g, device=packed.device) * std)
        packed[e].copy_(q)
        scale[e].copy_(s)


@torch.no_grad()
def init_random_weights(model: nn.Module, seed: int = 0) -> None:
    """Seeded weights in place, on the parameters' device. Quantized parameters (a release-format
    model) are drawn and quantized tensor by tensor; bf16/fp32 ones as before (a host generator,
    so CPU runs keep their values)."""
    g = torch.Generator().manual_seed(seed)
    n_layers = len(model.layers)
    out_scale = 1.0 / math.sqrt(2 * n_layers)  # sub-layer outputs add up over 2L sub-layers

    def normal(t: torch.Tensor, std: float) -> None:
        t.copy_(torch.randn(t.shape, generator=g) * std)

    tensors = dict(model.named_parameters())
    tensors.update(dict(model.named_buffers()))
    for name, p in tensors.items():
        leaf = name.rsplit(".", 1)[-1]
        if p.dtype == torch.float8_e4m3fn:
            _init_fp8_linear(name, p, tensors[name[: -len("weight")] + "weight_scale"], seed, out_scale)
        elif p.dtype == torch.int8 and p.dim() == 3:
            experts = model.get_submodule(name.rsplit(".", 1)[0])
            _init_fp4_experts(name, p, tensors[name + "_scale"], experts.first_expert, seed, out_scale)
        elif name.endswith("weight_scale") or (p.dtype == torch.uint8 and name.endswith("_scale")):
            continue  # written with their weights
        elif name.endswith("tid2eid"):
            n_exp = model.config.n_routed_experts
            rows = torch.stack([torch.randperm(n_exp, generator=g)[: p.shape[1]] for _ in range(p.shape[0])])
            p.copy_(rows.to(p.dtype))
        elif "norm" in name and leaf == "weight":
            p.fill_(1.0)
        elif name.endswith("attn_sink"):
            normal(p, 0.5)
        elif leaf == "ape":
            normal(p, 0.2)
        elif leaf == "bias" and "gate" in name:
            normal(p, 0.05)
        elif leaf == "fn":  # mHC mixing projections: small so mixes start near their bases
            normal(p, 0.1 / math.sqrt(p.shape[1]))
        elif leaf == "base":
            normal(p, 0.1)
        elif leaf == "scale":
            p.fill_(1.0)
        elif name == "embed.weight":
            normal(p, 1.0)
        elif name == "head.weight" and model.config.is_quantized:
            # the release stores its head in BF16 (held in fp32 here): values a bf16 head
            # holds exactly, so a bf16 model runs it on tensor cores (use_tensor_core_gemms)
            normal(p, 1.0 / math.sqrt(p.shape[1]))
            p.copy_(p.to(torch.bfloat16))
        elif p.dim() == 3:  # stacked experts [E, out, in]: the same values whatever the shard
            first = model.get_submodule(name.rsplit(".", 1)[0]).first_expert
            n_total = model.config.n_routed_experts
            std = 1.0 / math.sqrt(p.shape[2]) * (out_scale if name.endswith("w2") else 1.0)
            p.copy_((torch.randn((n_total, *p.shape[1:]), generator=g) * std)[first:first + p.shape[0]])
        elif p.dim() == 2:  # [out, in]
            std = 1.0 / math.sqrt(p.shape[1])
            if name.endswith(("wo_b.weight", "w2.weight")):
                std *= out_scale
            normal(p, std)
        else:
            raise ValueError(f"no initialisation rule for {name} {tuple(p.shape)}")
