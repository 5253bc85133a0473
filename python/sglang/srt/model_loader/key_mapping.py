"""Checkpoint key <-> model parameter name. Most names are identical; the exceptions are
the mHC tensors (grouped into modules here) and the routed experts (stacked here)."""

from __future__ import annotations

import re
from typing import Optional, Tuple

_HC = re.compile(r"^((?:layers|mtp)\.\d+\.)hc_(attn|ffn|head)_(fn|base|scale)$")
_HC_HEAD = re.compile(r"^hc_head_(fn|base|scale)$")
_EXPERT = re.compile(r"^((?:layers|mtp)\.\d+\.ffn\.experts)\.(\d+)\.(w[123])\.weight$")


def checkpoint_to_param(key: str) -> Tuple[str, Optional[int]]:
    """Returns (parameter name, expert index or None)."""
    if m := _HC.match(key):
        return f"{m[1]}hc_{m[2]}.{m[3]}", None
    if m := _HC_HEAD.match(key):
        return f"hc_head.{m[1]}", None
    if m := _EXPERT.match(key):
        return f"{m[1]}.{m[3]}", int(m[2])
    return key, None


_P_HC = re.compile(r"^((?:layers|mtp)\.\d+\.)hc_(attn|ffn|head)\.(fn|base|scale)$")
_P_HC_HEAD = re.compile(r"^hc_head\.(fn|base|scale)$")
_P_EXPERT = re.compile(r"^((?:layers|mtp)\.\d+\.ffn\.experts)\.(w[123])$")


def param_to_checkpoint(name: str, expert: Optional[int] = None) -> str:
    if m := _P_HC.match(name):
        return f"{m[1]}hc_{m[2]}_{m[3]}"
    if m := _P_HC_HEAD.match(name):
        return f"hc_head_{m[1]}"
    if m := _P_EXPERT.match(name):
        assert expert is not None
        return f"{m[1]}.{expert}.{m[2]}.weight"
    return name


def is_stacked_expert(name: str) -> bool:
    return _P_EXPERT.match(name) is not None
