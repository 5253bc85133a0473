"""Manifold-constrained hyper-connections (mHC): the residual stream is hc copies of d.

hc_pre mixes the copies into one sub-layer input; hc_post writes the sub-layer output back
with a doubly-stochastic (Sinkhorn-projected) mixing of the old copies. All math in fp32.
"""

from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.model_executor.forward_context import segment_kernel_ops


def sinkhorn_split(mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int,
                   iters: int, eps: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mixes [T, (2+hc)*hc] -> pre [T, hc], post [T, hc], comb [T, hc, hc] (rows i -> cols j)."""
    pre = torch.sigmoid(mixes[:, :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(mixes[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = (mixes[:, 2 * hc:] * scale[2] + base[2 * hc:]).unflatten(-1, (hc, hc))
    comb = comb.softmax(dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    # The loop ends on a column normalisation, as the reference does (rows drift by ~eps).
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre, post, comb


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

    def pre(self, x: torch.Tensor):
        """x [T, hc, d] -> (y [T, d], post, comb)."""
        kernels = segment_kernel_ops()
        if kernels is not None:
            return kernels.hc_pre(x, self.fn, self.scale, self.base, self.hc, self.iters, self.hc_eps,
                                  self.norm_eps)
        mixes, flat = _mix_input(x, self.fn, self.norm_eps)
        pre, post, comb = sinkhorn_split(mixes, self.scale, self.base, self.hc, self.iters, self.hc_eps)
        y = (pre.unsqueeze(-1) * flat.view(x.shape)).sum(dim=1)
        return y.to(x.dtype), post, comb

    @staticmethod
    def post(f: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """X'_j = post_j * f + sum_i comb[i, j] * X_i."""
        kernels = segment_kernel_ops()
        if kernels is not None:
            return kernels.hc_post(f, residual, post, comb)
        mixed = torch.einsum("tij,tid->tjd", comb, residual.float())
        return (post.unsqueeze(-1) * f.float().unsqueeze(1) + mixed).to(residual.dtype)


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
