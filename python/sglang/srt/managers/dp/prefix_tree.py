"""The DP router's picture of what each rank's prefix cache holds, without asking the ranks.

Each rank keeps its own radix tree (mem_cache/radix_cache.py), in its own process; querying it
per request would put a round trip to every rank on each request's path and could wait on a
rank that is blocked writing its outputs. Instead the router remembers the prompts it sent to
each rank, at the granularity the rank's cache works in: whole pages. A prompt is cut into
page-sized blocks, and block i is named by a key chained from the keys of blocks 0..i-1 and its
own tokens, so a key stands for the whole prefix up to its block's end (a path from the root of
a tree with page-wide edges). A rank's tree is then a dict of keys in recency order.

Approximate on purpose: a rank may have evicted what the router still lists (its cache is
bounded by its KV pool and shared with running requests), and the router never hears of the
generated tokens a rank caches on finish; a key collision (64-bit hashes) is as harmless as a
stale entry. Wrong guesses cost a cache miss, never a wrong answer."""

from __future__ import annotations

from collections import OrderedDict
from typing import List, Sequence


def block_keys(input_ids: Sequence[int], page_size: int) -> List[int]:
    """The chained key of each whole page of `input_ids` (a trailing partial page has none:
    a rank caches whole pages only)."""
    keys, parent = [], 0
    for end in range(page_size, len(input_ids) + 1, page_size):
        parent = hash((parent, tuple(input_ids[end - page_size:end])))
        keys.append(parent)
    return keys


class RankPrefixTree:
    """The prefixes sent to one rank, as page keys (`block_keys`), at most `capacity_blocks`
    of them; the least recently sent are forgotten first."""

    def __init__(self, capacity_blocks: int):
        if capacity_blocks < 1:
            raise ValueError(f"a rank's prefix tree needs room for at least one page, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, keys: Sequence[int]) -> int:
        """How many leading blocks of `keys` this rank was sent."""
        n = 0
        for k in keys:
            if k not in self._blocks:
                break
            n += 1
        return n

    def insert(self, keys: Sequence[int]) -> None:
        """Record a prompt's blocks as the most recently sent; forget the oldest beyond capacity.
        Deepest first, so a prefix is always more recent than its extensions and eviction takes
        a path's leaf before its root (an evicted inner block would strand the ones below it)."""
        for k in reversed(keys):
            if k in self._blocks:
                self._blocks.move_to_end(k)
            else:
                self._blocks[k] = None
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)
