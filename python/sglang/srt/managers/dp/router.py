"""Router of the DP controller: picks the rank of each request (round_robin, or least_loaded
by outstanding requests then tokens) and keeps the per-rank load from the outputs. Pure
bookkeeping, no processes or threads: its caller drives it from one thread."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

from sglang.srt.managers.io_struct import WAKE


@dataclass
class RankLoad:
    reqs: int = 0  # requests sent and not finished
    tokens: int = 0  # their prompt tokens + max_new_tokens (an upper bound of their work)


class DPRouter:
    """rid -> rank for every outstanding request and each rank's load; `route` for a new
    request, `on_outputs` with every TokenOut list (a final output releases its rid)."""

    def __init__(self, dp_size: int, method: str):
        self.dp_size = dp_size
        self.method = method
        self.load = [RankLoad() for _ in range(dp_size)]
        self.owner: Dict[str, int] = {}  # rid -> rank, until its final TokenOut
        self._cost: Dict[str, int] = {}
        self._next_rank = 0

    # ---- one thread ------------------------------------------------------------------

    def route(self, req) -> List[tuple]:
        """(rank, message) pairs to send for a new request: the request to the rank `assign`
        picks, and WAKE to the others when no rank had work (they are in their idle wait)."""
        idle = not self.owner
        rank = self.assign(req)
        wakes = [(r, WAKE) for r in range(self.dp_size) if r != rank] if idle else []
        return [(rank, req)] + wakes

    def assign(self, req) -> int:
        """The rank that serves `req`; counts it as outstanding there."""
        n = self.dp_size
        if n == 1:
            rank = 0
        elif self.method == "round_robin":
            rank = self._next_rank
        else:  # least_loaded: fewest outstanding requests, then tokens; ties rotate
            order = [(self._next_rank + i) % n for i in range(n)]
            rank = min(order, key=lambda r: (self.load[r].reqs, self.load[r].tokens))
        self._next_rank = (rank + 1) % n
        cost = len(req.input_ids) + req.sampling_params.max_new_tokens
        self.owner[req.rid] = rank
        self._cost[req.rid] = cost
        self.load[rank].reqs += 1
        self.load[rank].tokens += cost
        return rank

    def owner_of(self, rid: str) -> Optional[int]:
        return self.owner.get(rid)

    def on_outputs(self, outs) -> None:
        for out in outs:
            if out.finished:
                self.release(out.rid)

    def release(self, rid: str) -> None:
        rank = self.owner.pop(rid, None)
        if rank is not None:
            self.load[rank].reqs -= 1
            self.load[rank].tokens -= self._cost.pop(rid)

    @property
    def num_outstanding(self) -> int:
        return len(self.owner)
