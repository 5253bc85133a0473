"""Router of the DP controller: picks the rank of each request (round_robin; least_loaded by
outstanding requests then tokens; cache_aware: the rank holding the longest cached prefix of the
prompt, within a load bound, by the router's own picture of each rank's cache in
prefix_tree.py) and keeps the per-rank load from the outputs. Pure bookkeeping, no processes or
threads: its caller drives it from one thread."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

from sglang.srt.managers.dp.prefix_tree import RankPrefixTree, block_keys
from sglang.srt.managers.io_struct import WAKE

# Before the ranks report their KV pool size: room for this many tokens per rank's tree.
DEFAULT_TREE_TOKENS = 1 << 20


@dataclass
class RankLoad:
    reqs: int = 0  # requests sent and not finished
    tokens: int = 0  # their prompt tokens + max_new_tokens (an upper bound of their work)


class DPRouter:
    """rid -> rank for every outstanding request and each rank's load; `route` for a new
    request, `on_outputs` with every TokenOut list (a final output releases its rid)."""

    def __init__(self, dp_size: int, method: str, page_size: int = 128, max_imbalance: int = 4,
                 tree_tokens: int = DEFAULT_TREE_TOKENS):
        """cache_aware only: `page_size`, the ranks' cache granularity; `max_imbalance`, how many
        more outstanding requests than the least loaded rank a rank holding a longer prefix may
        have and still be chosen; `tree_tokens`, each rank's tree size (`set_tree_tokens`)."""
        if method not in ("round_robin", "least_loaded", "cache_aware"):
            raise ValueError(f"unknown load balance method {method!r}")
        if max_imbalance < 0:
            raise ValueError(f"max_imbalance must be >= 0, got {max_imbalance}")
        self.dp_size = dp_size
        self.method = method
        self.page_size = page_size
        self.max_imbalance = max_imbalance
        self.load = [RankLoad() for _ in range(dp_size)]
        self.owner: Dict[str, int] = {}  # rid -> rank, until its final TokenOut
        self._cost: Dict[str, int] = {}
        self._next_rank = 0
        self.trees: List[RankPrefixTree] = []
        if method == "cache_aware":
            self.set_tree_tokens(tree_tokens)
        self.cache_routed = 0  # requests sent to a rank for a prefix it holds (cache_aware)

    def set_tree_tokens(self, tokens: int) -> None:
        """Bound each rank's tree at `tokens` (a rank's KV pool can hold no more); forgets
        what was recorded so far."""
        blocks = max(1, tokens // self.page_size)
        self.trees = [RankPrefixTree(blocks) for _ in range(self.dp_size)]

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
        elif self.method == "cache_aware":
            rank = self._cache_aware(req.input_ids)
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

    def _cache_aware(self, input_ids) -> int:
        """The balance rule: among the ranks whose outstanding requests exceed the least loaded
        rank's by at most `max_imbalance`, the one holding the most whole pages of the prompt;
        ties (no rank holds any, say) by fewest outstanding requests, then tokens, then rotation,
        i.e. least_loaded. The least loaded rank always qualifies, so a prompt nobody holds, or
        a holder too far ahead, goes where least_loaded would send it."""
        n = self.dp_size
        keys = block_keys(input_ids, self.page_size)
        # a rank never serves a whole prompt from its cache: only pages before its last token count
        usable = keys[:-1] if keys and len(input_ids) % self.page_size == 0 else keys
        held = [tree.match(usable) for tree in self.trees]
        fewest = min(load.reqs for load in self.load)
        order = [(self._next_rank + i) % n for i in range(n)]
        eligible = [r for r in order if self.load[r].reqs <= fewest + self.max_imbalance]
        rank = min(eligible, key=lambda r: (-held[r], self.load[r].reqs, self.load[r].tokens))
        if held[rank]:
            self.cache_routed += 1
        self.trees[rank].insert(keys)
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
