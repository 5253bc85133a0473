"""Seeded random weights for the presets, scaled so activations stay O(1) through the mHC
residual streams and logits are finite and not degenerate at every preset."""

from __future__ import annotations

import math

import torch
from torch import nn


@torch.no_grad()
def init_random_weights(model: nn.Module, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    n_layers = len(model.layers)
    out_scale = 1.0 / math.sqrt(2 * n_layers)  # sub-layer outputs add up over 2L sub-layers

    def normal(t: torch.Tensor, std: float) -> None:
        t.copy_(torch.randn(t.shape, generator=g) * std)

    for name, p in list(model.named_parameters()) + list(model.named_buffers()):
        leaf = name.rsplit(".", 1)[-1]
        if name.endswith("tid2eid"):
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
        elif p.dim() == 3:  # stacked experts [E, out, in]
            std = 1.0 / math.sqrt(p.shape[2])
            normal(p, std * (out_scale if name.endswith("w2") else 1.0))
        elif p.dim() == 2:  # [out, in]
            std = 1.0 / math.sqrt(p.shape[1])
            if name.endswith(("wo_b.weight", "w2.weight")):
                std *= out_scale
            normal(p, std)
        else:
            raise ValueError(f"no initialisation rule for {name} {tuple(p.shape)}")
