"""The interface every FP4 routed-expert backend implements (backends/__init__.py picks one).

A backend is a stateless strategy; what it needs per layer lives on the experts module
(Fp4RoutedExperts): the release-format tensors w1/w3/w2 + scales as loaded, or whatever
`prepare` turned them into. Contract of `forward`, shared by all: out fp32 [T, d] = sum over
k of W2_e(SwiGLU_clamped(W1_e x, W3_e x) * weights[t, k]) for e = local_ids[t, k] in
[0, E_local) (other ids add nothing), the weight applied before W2; with act_quant, x and the
weighted activation are rounded to FP8 per 128 (power-of-two scales) before their GEMMs.
Graph-safe: static shapes and no host syncs in `forward`; anything that compiles or chooses
a kernel configuration happens in `prepare` or on the first eager call at a shape (the
graph runners warm up every bucket eagerly before capturing it)."""

from __future__ import annotations

import torch


class Fp4MoEBackend:
    name = "base"

    def prepare(self, experts) -> None:
        """Post-load, once, outside any graph capture: transform the loaded weights if this
        backend keeps its own layout. Default: use them as loaded."""

    def forward(self, experts, x: torch.Tensor, weights: torch.Tensor,
                local_ids: torch.Tensor, defer_sum: bool = False):
        """The contract's out; with defer_sum a backend whose last step is the top-k sum may
        return its rows before it instead (dsv4_kernels.moe.RoutedRows), for a consumer that
        sums them in its own launch."""
        raise NotImplementedError

    def weight_bytes(self, experts) -> int:
        """Device bytes this backend holds for the layer's routed experts."""
        return sum(t.numel() * t.element_size() for t in experts.expert_tensors().values())
