"""sgl-kernel's Triton FP4 MoE (dsv4_kernels.fp4_moe: the FP4 codes decoded inside the GEMMs,
tiles by rows per expert); the portable GPU path, and the reference on CPU tensors."""

from __future__ import annotations

import torch
from dsv4_kernels import ops

from sglang.srt.layers.moe.backends.base import Fp4MoEBackend


class TritonFp4MoE(Fp4MoEBackend):
    name = "triton"

    def forward(self, experts, x, weights, local_ids, defer_sum: bool = False):  # always the sum
        e = experts
        out = torch.empty(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        return ops.fp4_fused_moe(x, e.w1, e.w1_scale, e.w3, e.w3_scale, e.w2, e.w2_scale, local_ids, weights,
                                 e.limit, out, e.act_quant)
