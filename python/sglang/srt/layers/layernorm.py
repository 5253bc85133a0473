"""RMSNorm with an fp32 weight (checkpoints store norms in fp32); math in fp32."""

import torch
from torch import nn

from sglang.srt.model_executor.forward_context import segment_kernel_ops


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels = segment_kernel_ops()
        if kernels is not None:  # one launch; the torch chain below is eight fp32 passes
            return kernels.rms_norm(x, self.weight, self.eps)
        return (self.weight * rms_normalize(x, self.eps)).to(x.dtype)


class NormedInput:
    """x with the RMSNorm its consumers read it through (q_norm's output feeds wq_b and, in
    ratio-4 layers, the indexer's wq_b; norm None: x itself, which wq_a and wkv read).
    `through(linear)` is linear(norm(x)): with segment kernels a single row into an FP8 linear
    takes the norm into the GEMV's own launch, so a decode step runs no norm launch at all, and
    linears stacked on this input (quantization.fp8_linear.Fp8RowStack) share one launch up to
    64 rows: the first asks for all, the others read their columns of it (from two rows on a
    view whose rows are the stack's width apart). Every other consumer shares one computed
    norm(x)."""

    def __init__(self, x: torch.Tensor, norm: RMSNorm | None):
        self.x, self.norm = x, norm
        self._normed: torch.Tensor | None = None
        self._stacked: dict = {}  # Fp8RowStack -> its output for x

    def normed(self) -> torch.Tensor:
        if self._normed is None:
            self._normed = self.x if self.norm is None else self.norm(self.x)
        return self._normed

    def through(self, linear) -> torch.Tensor:
        kernels = segment_kernel_ops()
        stack = getattr(linear, "row_stack", None)
        if kernels is not None and stack is not None and kernels.stack_fuses(self.x, stack):
            if stack not in self._stacked:
                self._stacked[stack] = self._linear(kernels, stack)
            start, end = stack.columns[linear]
            return self._stacked[stack][:, start:end]
        if kernels is not None and self.norm is not None and kernels.rms_linear_fuses(self.x, linear):
            return self._linear(kernels, linear)
        return linear(self.normed())

    def _linear(self, kernels, linear) -> torch.Tensor:
        if self.norm is None:
            return kernels.fp8_block_linear(self.x, linear.weight, linear.weight_scale, linear.act_quant)
        return kernels.fp8_rms_linear(self.x, self.norm.weight, self.norm.eps, linear)
