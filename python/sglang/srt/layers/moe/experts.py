"""DSV4 MoE: routed experts with clamped SwiGLU plus a shared expert.

Expert weights are stacked ([E, I, d]) so the whole MoE has static shapes and can live
inside a captured graph segment. Two paths with the same semantics:
- the torch path (CPU, or --disable-segment-kernels) computes every expert for every row
  and weights by the (mostly zero) dense routing matrix: exact, graph-safe, fine for the
  small presets, E/top_k times the needed FLOPs;
- with the segment kernels (the default on CUDA: the attention backend's `segment_kernels`),
  sgl-kernel's grouped GEMM (dsv4_kernels.ops.fused_moe: Triton on CUDA, its torch reference
  elsewhere) runs only the (token, expert) pairs the router chose.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.layers.moe.ep_dispatch import dispatch_and_compute
from sglang.srt.layers.moe.router import Gate
from sglang.srt.model_executor.forward_context import get_forward_context, segment_kernel_ops


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    gate, up = gate.float(), up.float()
    if limit > 0:
        up = up.clamp(-limit, limit)
        gate = gate.clamp(max=limit)
    return F.silu(gate) * up


class SharedExpert(nn.Module):
    def __init__(self, dim: int, inter: int, limit: float, dtype: torch.dtype):
        super().__init__()
        self.limit = limit
        self.w1 = nn.Linear(dim, inter, bias=False, dtype=dtype)
        self.w2 = nn.Linear(inter, dim, bias=False, dtype=dtype)
        self.w3 = nn.Linear(dim, inter, bias=False, dtype=dtype)
        for p in self.parameters():
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(clamped_swiglu(self.w1(x), self.w3(x), self.limit).to(x.dtype))


class RoutedExperts(nn.Module):
    def __init__(self, n_experts: int, dim: int, inter: int, limit: float, dtype: torch.dtype):
        super().__init__()
        self.limit = limit
        self.n_total = n_experts  # routing ids index all experts, also when this rank holds a shard
        self.first_expert = 0  # > 0 when DP attention shards the experts across ranks
        # Only hash-routed layers can list an expert twice for a token; top-k routing cannot.
        self.may_repeat_ids = True
        self.w1 = nn.Parameter(torch.zeros(n_experts, inter, dim, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.zeros(n_experts, dim, inter, dtype=dtype), requires_grad=False)
        self.w3 = nn.Parameter(torch.zeros(n_experts, inter, dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, d], weights/ids [T, k] -> fp32 [T, d]."""
        kernels = segment_kernel_ops()
        if kernels is not None:
            return self._forward_grouped(x, weights, ids, kernels)
        n_local = self.w1.shape[0]
        dense = torch.zeros(x.shape[0], self.n_total, dtype=torch.float32, device=x.device)
        # scatter, not scatter_add: an expert listed twice for a token (hash tables can do
        # that) contributes once, exactly as the reference's `y[idx] += expert(...)` does.
        dense.scatter_(1, ids, weights)
        dense = dense[:, self.first_expert:self.first_expert + n_local]
        gate = torch.einsum("td,eid->eti", x, self.w1)
        up = torch.einsum("td,eid->eti", x, self.w3)
        # Routing weight applied before W2, as the reference does (matters in bf16).
        act = clamped_swiglu(gate, up, self.limit) * dense.t().unsqueeze(-1)
        return torch.einsum("eti,edi->td", act.to(x.dtype), self.w2).float()

    def _forward_grouped(self, x, weights, ids, kernels) -> torch.Tensor:
        """The routed pairs only, through fused_moe, which skips ids outside [0, n_local) and
        also scales by the weight before W2. Static shapes, no host sync: capturable."""
        # Local expert ids: under DP attention another rank's experts fall outside
        # [0, n_local) and are skipped, so they contribute exactly zero from this rank.
        local = ids - self.first_expert if self.first_expert else ids
        if self.may_repeat_ids and ids.shape[1] > 1:
            # An expert listed twice for a token (hash tables can do that) counts once, as in
            # the dense path and the reference; fused_moe would sum both. Both occurrences carry
            # the same gate score, so skipping every occurrence that has a later duplicate in
            # its row keeps exactly one at the right weight.
            later_dup = (ids[:, :, None] == ids[:, None, :]).triu(1).any(-1)
            local = local.masked_fill(later_dup, -1)
        out = torch.empty(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        return kernels.fused_moe(x, self.w1, self.w3, self.w2, local, weights, self.limit, out)

    @torch.no_grad()
    def keep_shard_(self, start: int, end: int) -> None:
        """Keep experts [start, end) only (this DP rank's share)."""
        self.first_expert = start
        for name in ("w1", "w2", "w3"):
            full = getattr(self, name)
            setattr(self, name, nn.Parameter(full[start:end].clone(), requires_grad=False))


class DeepseekV4MoE(nn.Module):
    def __init__(self, config, layer_id: int, dtype: torch.dtype):
        super().__init__()
        d, inter = config.hidden_size, config.moe_intermediate_size
        limit = config.swiglu_limit
        hash_vocab = config.vocab_size if config.is_hash_layer(layer_id) else None
        self.gate = Gate(d, config.n_routed_experts, config.num_experts_per_tok,
                         config.routed_scaling_factor, config.scoring_func, hash_vocab, dtype)
        self.experts = RoutedExperts(config.n_routed_experts, d, inter, limit, dtype)
        self.experts.may_repeat_ids = hash_vocab is not None
        shared_limit = limit if config.shared_expert_swiglu_limit else 0.0
        self.shared_experts = (
            SharedExpert(d, inter * config.n_shared_experts, shared_limit, dtype)
            if config.n_shared_experts > 0 else None
        )

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x, input_ids)
        # Under DP attention (expert parallel) the rows go to the ranks holding their experts
        # and come back summed (layers/moe/ep_dispatch.py); else the local experts run them.
        y = dispatch_and_compute(self.experts, x, weights, ids, get_forward_context().dp_moe)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x).float()
        return y.to(x.dtype)
