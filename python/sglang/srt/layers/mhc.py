"""Manifold-constrained hyper-connections (mHC): the residual stream is hc copies of d.

hc_pre mixes the copies into one sub-layer input; hc_post writes the sub-layer output back
with a doubly-stochastic (Sinkhorn-projected) mixing of the old copies. All math in fp32.
"""

from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F
from torch import nn

from dsv4_kernels import reference as kernel_reference

from sglang.srt.model_executor.forward_context import segment_kernel_ops


# The torch math lives once, in sgl-kernel's reference (what the fused kernels are tested
# against); on CPU and with --segment-kernels off the model runs it directly.
sinkhorn_split = kernel_reference.hc_sinkhorn_split


def _mix_input(x: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> Tuple[torch.Tensor, torch.Tensor]:
    flat = x.flatten(1).float()
    rsqrt = torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    return F.linear(flat, fn) * rsqrt, flat


class HyperConnection(nn.Module):
    """One sub-layer's mHC parameters (hc_{attn,ffn}_{fn,base,scale} in checkpoints)."""

    def __init__(self, hc: int, dim: int, iters: int, hc_eps: float, norm_eps: float):
        super().__init__()
        mix = (2 + hc) * hc
        self.hc, self.iters, self.hc_eps, self.norm_eps = hc, iters, hc_eps, norm_eps
        self.fn = nn.Parameter(torch.zeros(mix, hc * dim, dtype=torch.float32), requires_grad=False)
        self.base = nn.Parameter(torch.zeros(mix, dtype=torch.float32), requires_grad=False)
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32), requires_grad=False)

    def pre(self, x: torch.Tensor, norm=None):
        """x [T, hc, d] -> (y [T, d], post, comb); with `norm` (the sub-layer's RMSNorm) the
        first result is norm(y), in the same launch as the gated sum with the kernels."""
        ops = segment_kernel_ops()
        if ops is None:
            y, post, comb = kernel_reference.hc_pre(x, self.fn, self.scale, self.base, self.hc, self.iters,
                                                    self.hc_eps, self.norm_eps)
            return (y if norm is None else norm(y)), post, comb
        return ops.hc_pre(x, self.fn, self.scale, self.base, self.hc, self.iters, self.hc_eps, self.norm_eps,
                          rms_weight=None if norm is None else norm.weight, rms_eps=0.0 if norm is None else norm.eps)

    @staticmethod
    def post(f: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """X'_j = post_j * f + sum_i comb[i, j] * X_i."""
        ops = segment_kernel_ops() or kernel_reference
        return ops.hc_post(f, residual, post, comb)


class HyperHead(nn.Module):
    """Final collapse of the hc copies (no Sinkhorn): y = sum_i sigmoid(m_i*s + b_i)+eps * X_i."""

    def __init__(self, hc: int, dim: int, hc_eps: float, norm_eps: float):
        super().__init__()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.fn = nn.Parameter(torch.zeros(hc, hc * dim, dtype=torch.float32), requires_grad=False)
        self.base = nn.Parameter(torch.zeros(hc, dtype=torch.float32), requires_grad=False)
        self.scale = nn.Parameter(torch.ones(1, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mixes, flat = _mix_input(x, self.fn, self.norm_eps)
        pre = torch.sigmoid(mixes * self.scale + self.base) + self.hc_eps
        return (pre.unsqueeze(-1) * flat.view(x.shape)).sum(dim=1).to(x.dtype)
