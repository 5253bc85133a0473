"""Model configs: DeepseekV4Config (Hugging Face config.json compatible) and built-in presets."""

from sglang.srt.configs.deepseek_v4 import (
    ConfigError,
    DeepseekV4Config,
    estimate_num_parameters,
    estimate_weight_bytes,
    load_model_config,
)


def __getattr__(name: str):
    # Presets are imported on first use, so `python -m sglang.srt.configs.presets` runs the
    # module once as __main__ instead of finding it already imported by this package.
    if name in ("PRESETS", "get_preset"):
        from sglang.srt.configs import presets

        return getattr(presets, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ConfigError",
    "DeepseekV4Config",
    "PRESETS",
    "estimate_num_parameters",
    "estimate_weight_bytes",
    "get_preset",
    "load_model_config",
]
