"""The release weight format in the model: FP8 block-scaled linears (fp8_linear.py) and the
quantization mode every quantized module reads (which weights are quantized, whether the
release's activation rounding runs). The FP4 routed experts live with the MoE
(layers/moe/experts.py: Fp4RoutedExperts); every formula is sgl-kernel's quant_reference."""

from __future__ import annotations

from dataclasses import dataclass

QUANT_NUMERICS = ("weight_only", "release")


@dataclass(frozen=True)
class QuantMode:
    """fp8_linears / fp4_experts: how the weights are stored (from the model config).
    release_numerics: the release's rounding runs: activations to FP8 per 128 before every
    FP8/FP4 GEMM (act_quant), the indexer's q/k Hadamard-rotated and FP4-rounded, the KV
    nope dims rounded to FP8 (the KV side reads it from the runner config). Only a model with
    quantized weights has release numerics: a bf16 model always runs weight_only."""

    fp8_linears: bool = False
    fp4_experts: bool = False
    release_numerics: bool = False

    @property
    def act_quant(self) -> bool:
        return self.release_numerics

    @staticmethod
    def resolve_numerics(config, quant_numerics: str) -> str:
        if quant_numerics not in QUANT_NUMERICS:
            raise ValueError(f"quant_numerics must be one of {', '.join(QUANT_NUMERICS)}, got {quant_numerics!r}")
        return quant_numerics if config.is_quantized else "weight_only"

    @staticmethod
    def from_config(config, quant_numerics: str = "release") -> "QuantMode":
        numerics = QuantMode.resolve_numerics(config, quant_numerics)
        return QuantMode(config.fp8_linears, config.fp4_experts, numerics == "release")


BF16 = QuantMode()
