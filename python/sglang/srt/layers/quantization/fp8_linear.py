"""FP8 e4m3 block-scaled linear: the release's storage (weight e4m3 [N, K] + fp32 scale per
128x128 block [ceil(N/128), ceil(K/128)], the checkpoint's ue8m0 bytes converted at load)
kept quantized in memory; the GEMM is dsv4_kernels.ops.fp8_block_linear (cuBLAS or Triton on
CUDA, the torch reference elsewhere), graph-safe."""

from __future__ import annotations

import torch
from torch import nn

from sglang.srt.layers.quantization import QuantMode

FP8_DTYPE = torch.float8_e4m3fn
BLOCK = 128


class Fp8BlockLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, act_quant: bool):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.act_quant = act_quant  # release numerics: x rounded to FP8 per 128 along K first
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.ones(-(-out_features // BLOCK), -(-in_features // BLOCK),
                                                    dtype=torch.float32), requires_grad=False)
        self._cublas_scale: torch.Tensor | None = None  # see cublas_scale()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from dsv4_kernels import ops

        return ops.fp8_block_linear(x, self.weight, self.weight_scale, self.act_quant,
                                    cublas_scale=self.cublas_scale())

    def cublas_scale(self) -> torch.Tensor | None:
        """weight_scale in cuBLAS's layout where that needs a copy (CUDA, K/128 not a multiple
        of 4: rows zero-padded to 4), built once at the first forward outside graph capture (the
        graph runners' eager warm-up) and kept; None elsewhere (the kernel then takes a free view,
        or builds it inside that one call). It reflects weight_scale as loaded: the loader fills
        the weights before any forward, and nothing rewrites them after."""
        if self._cublas_scale is None and self.act_quant and self.weight.is_cuda and \
                (self.weight_scale.shape[1] % 4) and not torch.cuda.is_current_stream_capturing():
            from dsv4_kernels.fp8_scaled_mm import weight_scale_layout

            self._cublas_scale = weight_scale_layout(self.weight_scale)
        return self._cublas_scale

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] in fp32 (exact) or bf16 (exact while the scales are powers of two, as the
        release's ue8m0 scales are: check once with `scales_are_pow2`). Used for wo_a, which the
        release applies dequantized in its grouped einsum; pure tensor ops, so capturable."""
        from dsv4_kernels.ops import dequantize_fp8_block  # one Triton pass on CUDA

        return dequantize_fp8_block(self.weight, self.weight_scale, dtype)

    def grouped_forward(self, x: torch.Tensor) -> torch.Tensor:
        """Block-diagonal use (wo_a's grouped einsum): x [T, G, K] -> [T, G, N/G] in x.dtype,
        group g through weight rows [g N/G, (g+1) N/G), the weight-only FP8 GEMM of every group
        in one launch: the weight is read as e4m3 (1 byte per element) and never dequantized in
        memory. With bf16 x and power-of-two scales the products are those of the dense einsum,
        accumulated in fp32 and rounded once. Needs N/G % 128 == 0 (whole scale rows per group)
        and no act quant."""
        from dsv4_kernels import ops

        T, G, K = x.shape
        n = self.out_features // G
        if K != self.in_features or n * G != self.out_features or n % BLOCK:
            raise ValueError(f"grouped_forward: x {tuple(x.shape)} for weight {tuple(self.weight.shape)} "
                             f"(needs K = in_features and whole 128-row blocks per group)")
        return ops.fp8_grouped_linear(x, self.weight, self.weight_scale)

    def scales_are_pow2(self) -> bool:
        """Whether the bf16 dequantization is exact (reads the device: at load only)."""
        from dsv4_kernels.quant_reference import scales_are_pow2

        return scales_are_pow2(self.weight_scale)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, act_quant={self.act_quant}"


class Fp8RowStack:
    """FP8 block linears that read one input, their weights and scales made rows of one tensor
    each (the linears keep views of their rows, so nothing is held twice): up to 64 rows go
    through all of them in one launch (layernorm.NormedInput.through; the one-row GEMV or the
    Triton small-M GEMM), then each reads its columns of the output. A weight row's product is
    its own: for one row the GEMV's sum order depends on K alone (fp8_gemv.gemv_config), so each
    part is bit for bit the linear's own output; the GEMM splits K by the stack's tile count,
    so a part may differ from its linear alone in the order of fp32 sums. Every linear but the
    last needs whole 128-row scale blocks."""

    def __init__(self, linears: list):
        first = linears[0]
        if not all(isinstance(m, Fp8BlockLinear) for m in linears) or any(
                m.in_features != first.in_features or m.act_quant != first.act_quant for m in linears):
            raise ValueError("Fp8RowStack: FP8 block linears of one input size and numerics only")
        if any(m.out_features % BLOCK for m in linears[:-1]):
            raise ValueError(f"Fp8RowStack: all but the last need whole {BLOCK}-row blocks, got "
                             f"{[m.out_features for m in linears]}")
        self.act_quant = first.act_quant
        self.weight = torch.cat([m.weight.data for m in linears])
        self.weight_scale = torch.cat([m.weight_scale.data for m in linears])
        self.columns = {}
        start = 0
        for m in linears:
            end = start + m.out_features
            m.weight.data = self.weight[start:end]
            m.weight_scale.data = self.weight_scale[start // BLOCK:start // BLOCK + m.weight_scale.shape[0]]
            m.row_stack = self
            self.columns[m] = (start, end)
            start = end

    @staticmethod
    def stackable(linears: list) -> bool:
        return all(isinstance(m, Fp8BlockLinear) and getattr(m, "row_stack", None) is None for m in linears) and \
            len({(m.in_features, m.act_quant) for m in linears}) == 1 and \
            all(m.out_features % BLOCK == 0 for m in linears[:-1])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Every stacked linear's output for x, side by side ([rows, sum of out_features])."""
        from dsv4_kernels import ops

        return ops.fp8_block_linear(x, self.weight, self.weight_scale, self.act_quant)

    def cublas_scale(self) -> None:
        return None  # the stack only takes the GEMV or the Triton small-M GEMM


def make_linear(in_features: int, out_features: int, dtype: torch.dtype, quant: QuantMode) -> nn.Module:
    """The projection the config asks for: FP8 block-scaled for a release-format model, a
    plain bias-free nn.Linear in the model dtype otherwise."""
    if quant.fp8_linears:
        return Fp8BlockLinear(in_features, out_features, quant.act_quant)
    return nn.Linear(in_features, out_features, bias=False, dtype=dtype)


def dense_weight(linear: nn.Module, fp8_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A linear's weight as a dense tensor (FP8: dequantized to `fp8_dtype`; as stored otherwise)."""
    return linear.dequantized(fp8_dtype) if isinstance(linear, Fp8BlockLinear) else linear.weight
