"""Overlap scheduling's device side: sampled token ids that stay on the device until the host
needs them.

`FutureMap` is a device int64 buffer with one slot per in-flight sampled token. A step's
sampled ids are stored into it on the device; the host hands the next step a placeholder
`-slot` for every token it does not know yet, and `resolve` swaps the placeholders for the
stored ids on the device, in stream order, before the forward reads its input ids (so eager,
breakable-graph replay and decode-graph replay all see real ids: the graphs' static buffers
are filled from the resolved tensor).

`LaunchedStep` is one launched forward whose sampled ids the host has not read yet: a
non-blocking copy into pinned memory plus a CUDA event, waited on only when the host
processes the step (after it has launched the next one).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import torch

from sglang.srt.model_executor.host_to_device import to_device_async


class FutureMap:
    """Two halves of `max_rows` slots, used by alternate steps (slot 0 is never handed out, so
    a placeholder is always negative). Reusing a half two steps later is safe: by then the
    host has read the older step's ids (it processes step N before scheduling step N+2, so no
    placeholder of step N is left on the host) and step N+1, which read them on the device,
    was launched earlier on the same stream."""

    def __init__(self, max_rows: int, device: torch.device | str):
        if max_rows < 1:
            raise ValueError(f"FutureMap needs at least one row per step, got {max_rows}")
        self.max_rows = max_rows
        self.buf = torch.zeros(2 * max_rows + 1, dtype=torch.int64, device=device)
        self._half = 0

    def store(self, ids: torch.Tensor) -> int:
        """Write one step's sampled ids [n] (device) into the next half; returns the first slot
        (row i's placeholder is -(first + i))."""
        n = ids.shape[0]
        if n > self.max_rows:
            raise ValueError(f"{n} sampled rows in one step, the future map holds {self.max_rows}")
        first = 1 + self._half * self.max_rows
        self._half ^= 1
        self.buf[first:first + n].copy_(ids)
        return first

    def resolve(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids with every placeholder -slot replaced by the id stored there; no host sync
        and static shapes, so it is safe in any stream position."""
        return torch.where(input_ids < 0, self.buf[input_ids.neg().clamp_(min=0)], input_ids)


@dataclass(eq=False)
class LaunchedStep:
    """A launched forward: `reqs[i]` sampled one token, known on the host only as the
    placeholder `placeholders[i]` (in its `pending_ids`) until `wait_tokens` reads the copy."""

    reqs: List = field(default_factory=list)
    placeholders: List[int] = field(default_factory=list)
    host_ids: Optional[torch.Tensor] = None  # pinned on CUDA
    event: Optional[object] = None  # torch.cuda.Event recorded after the copies
    early_outs: List = field(default_factory=list)  # TokenOuts known at launch (max_new_tokens 0)
    # return_logprob: the positions in `reqs` that asked, and their layers/logprobs.py results
    # (chosen [n], top values [n, k], top ids [n, k]; top ones None when no row wants any)
    logprob_rows: List[int] = field(default_factory=list)
    host_logprobs: tuple = ()

    @staticmethod
    def copy_to_host(*tensors: Optional[torch.Tensor]):
        """(host tensors, event): non-blocking device->host copies the host waits on later,
        one event after all of them (None stays None)."""
        if all(t is None or t.device.type != "cuda" for t in tensors):
            return tensors, None
        hosts = []
        for t in tensors:
            if t is not None:
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
                t = host
            hosts.append(t)
        event = torch.cuda.Event()
        event.record()
        return tuple(hosts), event

    def wait_tokens(self) -> List[int]:
        if self.host_ids is None:
            return []
        if self.event is not None:
            self.event.synchronize()
        return self.host_ids.tolist()

    def logprobs_by_position(self) -> dict:
        """{position in reqs: (logprob, [(logprob, id), ...])} (after wait_tokens)."""
        if not self.logprob_rows:
            return {}
        chosen, top_vals, top_ids = self.host_logprobs
        chosen = chosen.tolist()
        top_vals = top_vals.tolist() if top_vals is not None else None
        top_ids = top_ids.tolist() if top_ids is not None else None
        out = {}
        for j, pos in enumerate(self.logprob_rows):
            k = self.reqs[pos].top_logprobs_num
            top = list(zip(top_vals[j][:k], top_ids[j][:k])) if k else []
            out[pos] = (chosen[j], top)
        return out


def rows_to_device(rows: List[int], device: torch.device) -> torch.Tensor:
    return to_device_async(torch.tensor(rows, dtype=torch.int64), device)
