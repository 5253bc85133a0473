"""The torch reference FP4 MoE (quant_reference.fp4_moe_ref): dense over experts, exact, the
contract every other backend is tested against; for CPU runs and tiny models."""

from __future__ import annotations

from dsv4_kernels.quant_reference import fp4_moe_ref

from sglang.srt.layers.moe.backends.base import Fp4MoEBackend


class ReferenceFp4MoE(Fp4MoEBackend):
    name = "torch"

    def forward(self, experts, x, weights, local_ids, defer_sum: bool = False):  # always the sum
        e = experts
        return fp4_moe_ref(x, e.w1, e.w1_scale, e.w3, e.w3_scale, e.w2, e.w2_scale, local_ids, weights,
                           e.limit, e.act_quant)
