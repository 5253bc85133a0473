"""Model configs: DeepseekV4Config (Hugging Face config.json compatible) and built-in presets."""

from sglang.srt.configs.deepseek_v4 import (
    ConfigError,
    DeepseekV4Config,
    estimate_num_parameters,
    estimate_weight_bytes,
    load_model_config,
)
from sglang.srt.configs.presets import PRESETS, get_preset

__all__ = [
    "ConfigError",
    "DeepseekV4Config",
    "PRESETS",
    "estimate_num_parameters",
    "estimate_weight_bytes",
    "get_preset",
    "load_model_config",
]
