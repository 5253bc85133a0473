"""Checkpoint key <-> model parameter name. Most names are identical; the exceptions are
the mHC tensors (grouped into modules here), the routed experts (stacked here, their FP4
scales as `w1_scale`...) and the FP8 block scales (`<linear>.scale` in the checkpoint,
`<linear>.weight_scale` here)."""

from __future__ import annotations

import re
from typing import Optional, Tuple

_HC = re.compile(r"^((?:layers|mtp)\.\d+\.)hc_(attn|ffn|head)_(fn|base|scale)$")
_HC_HEAD = re.compile(r"^hc_head_(fn|base|scale)$")
_EXPERT = re.compile(r"^((?:layers|mtp)\.\d+\.ffn\.experts)\.(\d+)\.(w[123])\.(weight|scale)$")
_FP8_SCALE = re.compile(r"^(.+)\.(scale|weight_scale_inv)$")


def checkpoint_to_param(key: str) -> Tuple[str, Optional[int]]:
    """Returns (parameter name, expert index or None)."""
    if m := _HC.match(key):
        return f"{m[1]}hc_{m[2]}.{m[3]}", None
    if m := _HC_HEAD.match(key):
        return f"hc_head.{m[1]}", None
    if m := _EXPERT.match(key):
        return f"{m[1]}.{m[3]}{'_scale' if m[4] == 'scale' else ''}", int(m[2])
    if m := _FP8_SCALE.match(key):
        return f"{m[1]}.weight_scale", None
    return key, None


_P_HC = re.compile(r"^((?:layers|mtp)\.\d+\.)hc_(attn|ffn|head)\.(fn|base|scale)$")
_P_HC_HEAD = re.compile(r"^hc_head\.(fn|base|scale)$")
_P_EXPERT = re.compile(r"^((?:layers|mtp)\.\d+\.ffn\.experts)\.(w[123])(_scale)?$")
_P_FP8_SCALE = re.compile(r"^(.+)\.weight_scale$")


def param_to_checkpoint(name: str, expert: Optional[int] = None) -> str:
    if m := _P_HC.match(name):
        return f"{m[1]}hc_{m[2]}_{m[3]}"
    if m := _P_HC_HEAD.match(name):
        return f"hc_head_{m[1]}"
    if m := _P_EXPERT.match(name):
        assert expert is not None
        return f"{m[1]}.{expert}.{m[2]}.{'scale' if m[3] else 'weight'}"
    if m := _P_FP8_SCALE.match(name):
        return f"{m[1]}.scale"
    return name


def is_stacked_expert(name: str) -> bool:
    return _P_EXPERT.match(name) is not None
