"""DSV4 MoE: routed experts with clamped SwiGLU plus a shared expert.

Expert weights are stacked ([E, I, d]) so the whole MoE has static shapes and can live
inside a captured graph segment. Two paths with the same semantics:
- the torch path (CPU, or --segment-kernels off) computes every expert for every row
  and weights by the (mostly zero) dense routing matrix: exact, graph-safe, fine for the
  small presets, E/top_k times the needed FLOPs;
- with the segment kernels (the default on CUDA: the attention backend's `segment_kernels`),
  sgl-kernel's grouped GEMM (dsv4_kernels.ops.fused_moe: Triton on CUDA, its torch reference
  elsewhere) runs only the (token, expert) pairs the router chose.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from dsv4_kernels import reference as kernel_reference
from torch import nn

from sglang.srt.layers.mhc import HyperConnection
from sglang.srt.layers.moe.backends import Fp4MoEBackend, make_fp4_backend
from sglang.srt.layers.moe.ep_dispatch import dispatch_and_compute
from sglang.srt.layers.quantization import BF16, QuantMode
from sglang.srt.layers.quantization.fp8_linear import Fp8BlockLinear, make_linear
from sglang.srt.layers.moe.router import Gate
from sglang.srt.model_executor.forward_context import get_forward_context, segment_kernel_ops


FP4_BLOCK = 32  # one e8m0 scale per 32 inputs of an FP4 expert row


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    gate, up = gate.float(), up.float()
    if limit > 0:
        up = up.clamp(-limit, limit)
        gate = gate.clamp(max=limit)
    return F.silu(gate) * up


class SharedExpert(nn.Module):
    def __init__(self, dim: int, inter: int, limit: float, dtype: torch.dtype, quant: QuantMode = BF16):
        super().__init__()
        self.limit = limit
        self.w1 = make_linear(dim, inter, dtype, quant)
        self.w2 = make_linear(inter, dim, dtype, quant)
        self.w3 = make_linear(dim, inter, dtype, quant)
        for p in self.parameters():
            p.requires_grad_(False)

    def takes_routed_rows(self) -> bool:
        """Whether forward takes the routed experts' rows before their top-k sum
        (dsv4_kernels.moe.RoutedRows) as `add`: FP8 weights with segment kernels, whose
        fp8_swiglu_linear_add sums them inside the down GEMV where that is one launch (a decode
        row on CUDA) and with sum_topk first everywhere else."""
        return isinstance(self.w2, Fp8BlockLinear) and segment_kernel_ops() is not None

    def forward(self, x: torch.Tensor, add=None, streams: Optional[tuple] = None) -> torch.Tensor:
        """The shared expert of x [T, d]; with `add` (fp32 [T, d], the routed experts' sum, or
        their rows before it where takes_routed_rows), (add + that) in fp32, rounded to x.dtype;
        with streams (residual, post, comb), the mHC streams after that result
        (HyperConnection.post)."""
        kernels = segment_kernel_ops()
        if kernels is not None:
            if isinstance(self.w1, Fp8BlockLinear):
                # one GEMV launch for gate and up of one row, one for the activation, down
                # projection, sum and post step (fp8_gemv's SWIGLU / ADD / HC steps)
                gate, up = kernels.fp8_block_linear_pair(x, self.w1, self.w3)
                if add is not None:
                    return kernels.fp8_swiglu_linear_add(gate, up, self.w2, self.limit, add, streams)
            else:
                gate, up = self.w1(x), self.w3(x)
            y = self.w2(kernels.swiglu_clamped(gate, up, self.limit, x.dtype))  # one launch for the fp32 chain
            if add is not None:
                y = kernels.add_fp32(add, y, x.dtype)
        else:
            y = self.w2(clamped_swiglu(self.w1(x), self.w3(x), self.limit).to(x.dtype))
            if add is not None:
                y = (add + y.float()).to(x.dtype)
        return y if streams is None else HyperConnection.post(y, *streams)


class RoutedExperts(nn.Module):
    def __init__(self, n_experts: int, dim: int, inter: int, limit: float, dtype: torch.dtype,
                 expert_range: Optional[Tuple[int, int]] = None):
        """expert_range: the experts [start, end) this rank holds (DP attention), known before
        any weight is allocated or loaded; None: all of them."""
        super().__init__()
        self.limit = limit
        self.n_total = n_experts  # routing ids index all experts, also when this rank holds a shard
        start, end = expert_range or (0, n_experts)
        if not 0 <= start < end <= n_experts:
            raise ValueError(f"expert_range {expert_range} is not a non-empty range within [0, {n_experts})")
        self.first_expert = start  # > 0 when DP attention shards the experts across ranks
        # Only hash-routed layers can list an expert twice for a token; top-k routing cannot.
        self.may_repeat_ids = True
        self._alloc(end - start, dim, inter, dtype)

    def _alloc(self, n_local: int, dim: int, inter: int, dtype: torch.dtype) -> None:
        self.w1 = nn.Parameter(torch.zeros(n_local, inter, dim, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.zeros(n_local, dim, inter, dtype=dtype), requires_grad=False)
        self.w3 = nn.Parameter(torch.zeros(n_local, inter, dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                defer_sum: bool = False) -> torch.Tensor:
        """x [T, d], weights/ids [T, k] -> fp32 [T, d] (always the sum: defer_sum is for FP4 backends)."""
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

    def _local_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Routing ids as this rank's local expert ids, -1 (skipped) for duplicates."""
        # Under DP attention another rank's experts fall outside [0, n_local) and are
        # skipped, so they contribute exactly zero from this rank. An expert listed twice for
        # a token (hash tables can do that) counts once, as in the dense path and the
        # reference; the grouped GEMMs would sum both (reference.local_expert_ids).
        repeats = self.may_repeat_ids and ids.shape[1] > 1
        if not repeats and not self.first_expert:
            return ids
        return (segment_kernel_ops() or kernel_reference).local_expert_ids(ids, self.first_expert, repeats)

    def _forward_grouped(self, x, weights, ids, kernels) -> torch.Tensor:
        """The routed pairs only, through fused_moe, which skips ids outside [0, n_local) and
        also scales by the weight before W2. Static shapes, no host sync: capturable."""
        out = torch.empty(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        return kernels.fused_moe(x, self.w1, self.w3, self.w2, self._local_ids(ids), weights, self.limit, out)

    @torch.no_grad()
    def keep_shard_(self, start: int, end: int) -> None:
        """Keep experts [start, end) only (this DP rank's share) of a model built whole. The
        runner builds sharded models directly (expert_range) instead; kept for layer tests."""
        if self.first_expert or self.w1.shape[0] != self.n_total:
            raise RuntimeError("keep_shard_ needs a model holding all experts")
        self.first_expert = start
        for name, p in list(self.named_parameters(recurse=False)):
            setattr(self, name, nn.Parameter(p[start:end].clone(), requires_grad=False))


class Fp4RoutedExperts(RoutedExperts):
    """Routed experts in the release format, kept packed as loaded: w1/w3 int8 [E_local, inter,
    d/2], w2 int8 [E_local, d, inter/2] (two e2m1 codes per byte, element 2j in the low nibble)
    and w*_scale uint8 raw e8m0 bytes [E_local, out, in/32]. Who multiplies them is a backend
    (layers/moe/backends/: the torch reference, sgl-kernel's Triton kernel, humming), attached
    after load by `use_backend` (which may move the tensors into the backend's own layout); until
    then the Triton one (the reference on CPU tensors). Every backend keeps the duplicate-id,
    weight-before-W2 and shard semantics of the bf16 experts (quant_reference.fp4_moe_ref)."""

    def __init__(self, n_experts: int, dim: int, inter: int, limit: float, act_quant: bool,
                 expert_range: Optional[Tuple[int, int]] = None, model_dtype: torch.dtype = torch.bfloat16):
        self.act_quant = act_quant
        super().__init__(n_experts, dim, inter, limit, torch.int8, expert_range)
        self.model_dtype = model_dtype  # the activations' dtype (the parameters are packed bytes)
        self.backend = make_fp4_backend("triton")

    def _alloc(self, n_local: int, dim: int, inter: int, dtype: torch.dtype) -> None:
        for name, (rows, cols) in (("w1", (inter, dim)), ("w2", (dim, inter)), ("w3", (inter, dim))):
            if cols % FP4_BLOCK:
                raise ValueError(f"FP4 experts: {name} input dim {cols} is not a multiple of {FP4_BLOCK}")
            setattr(self, name, nn.Parameter(torch.zeros(n_local, rows, cols // 2, dtype=torch.int8),
                                             requires_grad=False))
            setattr(self, f"{name}_scale", nn.Parameter(
                torch.full((n_local, rows, cols // FP4_BLOCK), 127, dtype=torch.uint8), requires_grad=False))

    def use_backend(self, backend: Fp4MoEBackend) -> None:
        """Post-load, once, outside graph capture: multiply with `backend` from now on."""
        if backend.name == self.backend.name:
            return
        if self.backend.name == "humming":  # the packed originals are gone
            raise RuntimeError("FP4 experts already moved to the humming backend's layout")
        backend.prepare(self)
        self.backend = backend

    def expert_tensors(self) -> dict:
        """The device tensors holding these experts' weights, in whatever layout the backend keeps."""
        return dict(list(self.named_parameters(recurse=False)) + list(self.named_buffers(recurse=False)))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, defer_sum: bool = False):
        """x [T, d], weights/ids [T, k] -> fp32 [T, d]; with defer_sum the backend may return
        the rows before their top-k sum instead (RoutedRows, see Fp4MoEBackend.forward)."""
        return self.backend.forward(self, x, weights, self._local_ids(ids), defer_sum)


class DeepseekV4MoE(nn.Module):
    def __init__(self, config, layer_id: int, dtype: torch.dtype, quant: QuantMode = BF16,
                 expert_range: Optional[Tuple[int, int]] = None):
        super().__init__()
        d, inter = config.hidden_size, config.moe_intermediate_size
        limit = config.swiglu_limit
        hash_vocab = config.vocab_size if config.is_hash_layer(layer_id) else None
        self.gate = Gate(d, config.n_routed_experts, config.num_experts_per_tok,
                         config.routed_scaling_factor, config.scoring_func, hash_vocab, dtype)
        if quant.fp4_experts:
            self.experts = Fp4RoutedExperts(config.n_routed_experts, d, inter, limit, quant.act_quant, expert_range,
                                            dtype)
        else:
            self.experts = RoutedExperts(config.n_routed_experts, d, inter, limit, dtype, expert_range)
        self.experts.may_repeat_ids = hash_vocab is not None
        shared_limit = limit if config.shared_expert_swiglu_limit else 0.0
        self.shared_experts = (
            SharedExpert(d, inter * config.n_shared_experts, shared_limit, dtype, quant)
            if config.n_shared_experts > 0 else None
        )

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, streams: Optional[tuple] = None) -> torch.Tensor:
        """x [T, d] -> the MoE output [T, d]; with streams (residual, post, comb), the mHC
        streams after it (HyperConnection.post), at decode in the shared expert's last launch."""
        weights, ids = self.gate(x, input_ids)
        # Under DP attention (expert parallel) the rows go to the ranks holding their experts
        # and come back summed (layers/moe/ep_dispatch.py); else the local experts run them.
        dp_moe = get_forward_context().dp_moe
        if dp_moe is None and self.shared_experts is not None and self.shared_experts.takes_routed_rows():
            # the routed rows' top-k sum inside the shared expert's last launch (RoutedRows)
            y = self.experts(x, weights, ids, defer_sum=True)
        else:
            y = dispatch_and_compute(self.experts, x, weights, ids, dp_moe)
        if self.shared_experts is not None:
            return self.shared_experts(x, add=y, streams=streams)  # y + shared in fp32, rounded once
        y = y.to(x.dtype)
        return y if streams is None else HyperConnection.post(y, *streams)
