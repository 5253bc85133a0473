"""Test-only: force what matching requests generate, so end-to-end tests drive the whole path
from token ids to the API's parsed fields (tool calls, reasoning) on a random-weight model.

Enabled only by `SGLANG_TEST_SCRIPTED_OUTPUTS=<file>`, a JSON list of
`{"prompt_contains": [ids], "output": [ids]}`: a request whose prompt contains those ids (in a
row; the latest occurrence wins) generates `output`, then the model's EOS. Forced ids replace sampled ones before they feed
the next step, so the model and the KV cache see exactly what the client gets."""

from __future__ import annotations

import json
import os

import torch

ENV = "SGLANG_TEST_SCRIPTED_OUTPUTS"


def _last_index(seq: list[int], part: list[int]) -> int:
    n = len(part)
    return max((i for i in range(len(seq) - n + 1) if seq[i:i + n] == part), default=-1)


class ScriptedOutputs:
    def __init__(self, scripts: list[dict], eos_id: int):
        self.scripts = [(list(s["prompt_contains"]), list(s["output"])) for s in scripts]
        self.eos_id = eos_id

    @classmethod
    def from_env(cls, eos_id: int) -> ScriptedOutputs | None:
        path = os.environ.get(ENV)
        if not path:
            return None
        with open(path) as f:
            return cls(json.load(f), eos_id)

    def script_of(self, prompt_ids: list[int]) -> list[int] | None:
        """The script whose ids occur latest in the prompt (a conversation's last turn)."""
        where, output = max(((_last_index(prompt_ids, part), out) for part, out in self.scripts),
                            key=lambda t: t[0], default=(-1, None))
        return output if where >= 0 else None

    def apply(self, reqs, ids: torch.Tensor) -> torch.Tensor:
        """`ids` (one sampled id per request) with scripted requests' next ids forced."""
        forced = {}
        for j, req in enumerate(reqs):
            script = self.script_of(req.origin_input_ids)
            if script is not None:
                k = len(req.output_ids) + len(req.pending_ids)  # ids this request already has
                forced[j] = script[k] if k < len(script) else self.eos_id
        if not forced:
            return ids
        ids = ids.clone()
        for j, tok in forced.items():
            ids[j] = tok
        return ids
