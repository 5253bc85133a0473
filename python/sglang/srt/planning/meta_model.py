"""The model's tensors as it holds them, without memory: DeepseekV4ForCausalLM built once on
the meta device (shapes and dtypes only, well under a second for Pro). The memory planner and
the step cost model both count bytes from this one walk, so they never disagree with the model
or with each other; release-format configs build the quantized modules the loader fills, so
FP8 / FP4 storage counts as held, not re-derived."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang.srt.configs.deepseek_v4 import DeepseekV4Config
from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM


@dataclass(frozen=True)
class MetaTensor:
    name: str  # the parameter or buffer name in the model (`layers.3.ffn.experts.w1`, ...)
    shape: tuple[int, ...]
    nbytes: int  # as held: elements x the dtype's size


def meta_tensors(config: DeepseekV4Config, dtype: str = "bfloat16") -> list[MetaTensor]:
    """Every parameter and buffer of the model (the MTP modules the config lists included)
    built in `dtype`."""
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(config, getattr(torch, dtype), max_positions=2)
    return [
        MetaTensor(name, tuple(t.shape), t.numel() * t.element_size())
        for name, t in list(model.named_parameters()) + list(model.named_buffers())
    ]
