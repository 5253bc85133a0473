"""Per-request sampling parameters, validated at the process boundary so a bad request is a
400 with the offending field named, never a failure inside a batch."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Optional

_MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes any 64-bit value; keep it signed-safe


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 means the whole vocabulary
    min_p: float = 0.0
    seed: Optional[int] = None  # per-request generator: same seed + prompt -> same output
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1  # only 1: parallel sampling is not supported

    @classmethod
    def from_dict(cls, d: Optional[dict]) -> SamplingParams:
        """Build from a JSON object; unknown keys and wrong types raise ValueError.

        A null value means "use the default" (JSON clients send it for omitted options), and a
        single stop string is accepted for `stop` (as OpenAI's API does).
        """
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise ValueError(f"sampling_params must be an object, got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(map(repr, unknown))}")
        kwargs = {k: v for k, v in d.items() if v is not None}
        if isinstance(kwargs.get("stop"), str):
            kwargs["stop"] = [kwargs["stop"]]
        params = cls(**kwargs)
        params.verify()
        return params

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def verify(self, vocab_size: Optional[int] = None) -> None:
        """Raise ValueError naming the first bad field. Types are checked too, so params built
        directly (not through from_dict) get the same errors."""
        if not _is_int(self.max_new_tokens):
            raise ValueError(f"max_new_tokens must be an integer, got {self.max_new_tokens!r}")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        for name in ("temperature", "top_p", "min_p"):
            v = getattr(self, name)
            if not _is_number(v) or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not _is_int(self.top_k):
            raise ValueError(f"top_k must be an integer, got {self.top_k!r}")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"top_k must be -1 or >= 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= _MAX_SEED):
            raise ValueError(f"seed must be null or an integer in [0, 2**63 - 1], got {self.seed!r}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if any(s == "" for s in self.stop):
            raise ValueError("stop must not contain an empty string")
        if not isinstance(self.stop_token_ids, list) or not all(_is_int(t) for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be a list of integers, got {self.stop_token_ids!r}")
        for t in self.stop_token_ids:
            if t < 0 or (vocab_size is not None and t >= vocab_size):
                raise ValueError(f"stop_token_ids entry {t} is outside the vocabulary [0, {vocab_size})")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be true or false, got {self.ignore_eos!r}")
        if not _is_int(self.n) or self.n != 1:
            raise ValueError(f"n must be 1 (parallel sampling is not supported), got {self.n!r}")
