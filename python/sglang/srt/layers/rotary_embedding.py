"""Interleaved (GPT-J pair) partial RoPE with DeepSeek's YaRN frequency ramp.

Layers with compress ratio 0 use rope_theta without YaRN; compressed layers use
compress_rope_theta with YaRN (no mscale), exactly as DeepSeek's reference does.
"""

from __future__ import annotations

import math
from typing import Tuple

import torch


def yarn_inv_freq(rope_dim: int, base: float, factor: float, original_max_pos: int,
                  beta_fast: float, beta_slow: float) -> torch.Tensor:
    freqs = 1.0 / (base ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    if original_max_pos <= 0:
        return freqs

    def correction_dim(rotations: float) -> float:
        return rope_dim * math.log(original_max_pos / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    smooth = 1 - ramp
    return freqs / factor * (1 - smooth) + freqs * smooth


class RotaryTable:
    """cos/sin tables [max_pos, rope_dim/2] (fp32) for one (theta, yarn) setting."""

    def __init__(self, rope_dim: int, max_pos: int, base: float, factor: float = 1.0,
                 original_max_pos: int = 0, beta_fast: float = 32, beta_slow: float = 1,
                 device=None):
        self.rope_dim = rope_dim
        inv = yarn_inv_freq(rope_dim, base, factor, original_max_pos, beta_fast, beta_slow)
        angles = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv)
        self.cos = angles.cos().to(device)
        self.sin = angles.sin().to(device)

    def lookup(self, positions: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions], self.sin[positions]


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last 2*cos.shape[-1] dims of x in place (pairs (2k, 2k+1)).

    x: [T, ..., D]; cos/sin: [T, rope_dim/2] broadcast over the middle dims. Math in fp32.
    """
    rd = cos.shape[-1] * 2
    tail = x[..., -rd:]
    pairs = tail.float().unflatten(-1, (-1, 2))
    while cos.dim() < pairs.dim() - 1:
        cos = cos.unsqueeze(-2)
        sin = sin.unsqueeze(-2)
    if inverse:
        sin = -sin
    a, b = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    tail.copy_(rotated.to(x.dtype))
    return x
