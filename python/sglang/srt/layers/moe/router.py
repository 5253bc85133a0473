"""DSV4 router: sqrt-softplus scores in fp32; a selection-only bias; hash routing on the
first layers (a frozen token -> experts table). Weights are the raw scores at the chosen
experts, normalised to sum 1, times routed_scaling_factor. Static shapes: graph-safe. With the
segment kernels (CUDA) everything after the logits GEMM is one launch (dsv4_kernels.router)."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from dsv4_kernels import reference
from dsv4_kernels.reference import topk_indices
from torch import nn

from sglang.srt.layers.tensor_core_gemm import mm_fp32, tensor_core_eligible
from sglang.srt.model_executor.forward_context import segment_kernel_ops


def route(logits: torch.Tensor, topk: int, scaling: float, scoring_func: str,
          bias: Optional[torch.Tensor] = None, tid2eid: Optional[torch.Tensor] = None,
          input_ids: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] fp32 -> (weights [T, k] fp32, expert ids [T, k] int64). DSV4's
    sqrt-softplus routing is the kernels' reference formula (dsv4_kernels.reference.moe_route,
    which the Triton router matches); the other scoring functions are computed here."""
    if scoring_func == "sqrtsoftplus":
        return reference.moe_route(logits, bias, topk, scaling, tid2eid, input_ids, ids_dtype=torch.int64)
    if scoring_func == "sigmoid":
        scores = logits.sigmoid()
    elif scoring_func == "softmax":
        scores = logits.softmax(dim=-1)
    else:
        raise ValueError(f"unknown scoring_func {scoring_func!r}")
    if tid2eid is not None:
        ids = tid2eid[input_ids].long()
    else:
        selection = scores if bias is None else scores + bias
        ids = topk_indices(selection, topk)  # ties: the lower expert id, on every device
    weights = scores.gather(1, ids)
    if scoring_func != "softmax":
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * scaling, ids


class Gate(nn.Module):
    def __init__(self, dim: int, n_experts: int, topk: int, scaling: float, scoring_func: str,
                 hash_vocab: Optional[int], dtype: torch.dtype):
        super().__init__()
        self.topk, self.scaling, self.scoring_func = topk, scaling, scoring_func
        self.weight = nn.Parameter(torch.zeros(n_experts, dim, dtype=dtype), requires_grad=False)
        if hash_vocab is not None:
            self.register_buffer("tid2eid", torch.zeros(hash_vocab, topk, dtype=torch.int32))
            self.bias = None
        else:
            self.tid2eid = None
            self.bias = nn.Parameter(torch.zeros(n_experts, dtype=torch.float32), requires_grad=False)
        self.tensor_core_logits = False  # set by use_tensor_core_gemms after load

    def use_tensor_core_gemms(self, model_dtype: torch.dtype, enabled: bool = True) -> None:
        """On a bf16 model on CUDA: the fp32 logits from one bf16 GEMM with an fp32 output (x and
        the weight are bf16, so the products are exact; only the summation order changes)."""
        self.tensor_core_logits = (enabled and tensor_core_eligible(model_dtype, self.weight.device)
                                   and self.weight.dtype == torch.bfloat16)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor):
        kernels = segment_kernel_ops()
        if self.tensor_core_logits and kernels is not None and kernels.bf16_gemv_takes(x, self.weight):
            logits = kernels.bf16_gemv(x, self.weight)  # a decode row: one launch (cuBLAS: split-K + sum)
        elif self.tensor_core_logits:
            logits = mm_fp32(x, self.weight.t())
        else:
            logits = F.linear(x.float(), self.weight.float())
        if kernels is not None and self.scoring_func == "sqrtsoftplus":  # one launch on CUDA, torch's experts
            return kernels.moe_route(logits, self.bias, self.topk, self.scaling, self.tid2eid, input_ids,
                                     ids_dtype=torch.int64)
        return route(logits, self.topk, self.scaling, self.scoring_func, self.bias, self.tid2eid, input_ids)
