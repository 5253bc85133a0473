"""A model path to its config: a preset name, a checkpoint directory holding config.json, or a
.json file. Resolution only; the configs themselves live in deepseek_v4.py and presets.py."""

from __future__ import annotations

import os

from sglang.srt.configs.deepseek_v4 import DeepseekV4Config, with_num_layers
from sglang.srt.configs.presets import PRESETS


def load_model_config(model_path: str, num_layers: int | None = None) -> DeepseekV4Config:
    """A preset name, a checkpoint directory holding config.json, or a path to a .json file;
    `num_layers` keeps only the first layers (`with_num_layers`)."""
    c = _load_model_config(model_path)
    return c if num_layers is None else with_num_layers(c, num_layers)


def _load_model_config(model_path: str) -> DeepseekV4Config:
    if model_path in PRESETS:
        return PRESETS[model_path]()
    if os.path.isdir(model_path) and os.path.isfile(os.path.join(model_path, "config.json")):
        return DeepseekV4Config.from_json_file(os.path.join(model_path, "config.json"))
    if model_path.endswith(".json") and os.path.isfile(model_path):
        return DeepseekV4Config.from_json_file(model_path)
    raise ValueError(
        f"model path {model_path!r} is neither a preset ({', '.join(PRESETS)}),"
        " a directory with config.json, nor a .json file"
    )
