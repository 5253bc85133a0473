"""Prefix cache: a radix tree over token ids whose edges are whole KV pages, and partial tails.

A node owns (holds, in the page allocator's counts) the pages of its edge, and with them every
cache that lives in those pages: c4 / c128 compressed entries and indexer keys (the slot of
position p is page * page_size + p % page_size; compressed entries at slot // ratio).
Raw KV (per-request window rings) and the compressors' per-request ring state cannot be
rebuilt from pages, so a node may also hold the `ResumeState` at its end; a prefix matches only
up to a node end that has one. Nodes made by splitting an edge have none (the state in the
middle of an edge was never taken).

Tails: a request that finishes between page boundaries leaves the tokens past its last boundary
as a tail, a leaf whose edge is part of one page (fewer than page_size tokens) with the
state at its end. A match may end there; the page is then the template of the request's own
copy (it writes the rest of that page), never mapped shared. Tails hang off the node at the
boundary before them, in its children under their whole key (shorter than a page's key, so a
full-page lookup never meets one).

Locks: a request using a cached prefix locks its node, which counts on the node and every
ancestor; a locked node is never evicted. Eviction frees unlocked leaves, least recently used
first, until the pages asked for are free (the pool calls it before an allocation fails) or
until the states fit their host-memory budget (`trim_states`).
Every page of an unlocked node is held by the tree alone (a request holding a cached page
locks a node at or below it), so evicting it frees it.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from sglang.srt.mem_cache.allocator import RefCountedPageAllocator
from sglang.srt.mem_cache.resume_state import ResumeState


class TreeNode:
    __slots__ = ("key", "pages", "children", "parent", "lock_ref", "last_access", "state", "end", "num_tails")

    def __init__(self, key: tuple, pages: List[int], parent: Optional["TreeNode"], end: int):
        self.key = key  # token ids of the edge into this node: len(pages) * page_size, or a tail's fewer
        self.pages = pages
        self.children: Dict[tuple, TreeNode] = {}  # by the first page's token ids; tails by their key
        self.num_tails = 0  # children that are tails
        self.parent = parent
        self.lock_ref = 0
        self.last_access = 0
        self.state: Optional[ResumeState] = None  # the state after `end` tokens, when taken
        self.end = end  # tokens from the root to this node's end


@dataclass
class PrefixMatch:
    node: TreeNode  # the deepest node with a resume state within the limit (the root: none)
    length: int  # tokens matched (0 for no match; not a multiple of page_size when it ends in a tail)
    pages: List[int]  # the pages of positions [0, length); a tail's page last
    state: Optional[ResumeState]

    def shared_pages(self, page_size: int) -> List[int]:
        """The pages a request maps as they are: every page but a tail's."""
        return self.pages[: self.length // page_size]

    def tail_page(self, page_size: int) -> Optional[int]:
        """The partial page a match ending in a tail copies, else None."""
        return self.pages[-1] if self.length % page_size else None


class RadixCache:
    def __init__(self, allocator: RefCountedPageAllocator, page_size: int):
        self.allocator = allocator
        self.page_size = page_size
        self.root = TreeNode((), [], None, 0)
        self.root.lock_ref = 1  # never evicted
        self._clock = 0
        self.evictable_pages = 0  # pages of unlocked nodes
        self.cached_pages = 0  # pages of all nodes
        self.cached_tokens = 0  # tokens of all edges
        self.num_nodes = 0
        self.num_states = 0
        self.state_bytes = 0
        self.evicted_pages = 0
        self.version = 0  # changes whenever what a match could return changes (insertions, evictions)

    # ---- lookup and insertion --------------------------------------------------------

    def match_prefix(self, tokens: Sequence[int], max_len: int, touch: bool = True) -> PrefixMatch:
        """The longest cached prefix of `tokens`, at most `max_len` long, that ends at a node
        with a resume state (a tail included). Refreshes the LRU time of that node's path
        (unless `touch` is false: a look that takes nothing); locks nothing."""
        ps = self.page_size
        node, pos, pages = self.root, 0, []
        best = PrefixMatch(self.root, 0, [], None)
        while True:
            tail = self._longest_tail(node, tokens, pos, max_len)
            if tail is not None and pos + len(tail.key) > best.length:
                best = PrefixMatch(tail, pos + len(tail.key), pages + tail.pages, tail.state)
            if pos + ps > max_len:
                break
            child = node.children.get(tuple(tokens[pos:pos + ps]))
            if child is None:
                break
            n = len(child.key)
            if pos + n > max_len or tuple(tokens[pos:pos + n]) != child.key:
                break  # a state exists only at a node's end
            node, pos = child, pos + n
            pages.extend(child.pages)
            if node.state is not None and pos > best.length:
                best = PrefixMatch(node, pos, list(pages), node.state)
        if touch:
            self._touch(best.node)
        return best

    def insert(self, tokens: Sequence[int], pages: Sequence[int], state: Optional[ResumeState]) -> TreeNode:
        """Cache `tokens` (whole pages) with their `pages` and the resume state at their end.
        Positions the tree already has keep the tree's pages (the caller keeps its own
        copies); the tree takes a hold on each page it adopts. Returns the node at the end."""
        ps = self.page_size
        n = len(tokens)
        self.version += 1
        if n == 0 or n % ps or len(pages) * ps != n:
            raise ValueError(f"insert needs whole pages: {n} tokens, {len(pages)} pages of {ps}")
        if state is not None and state.length != n:
            raise ValueError(f"resume state after {state.length} tokens cannot end a {n}-token prefix")
        node, pos = self.root, 0
        while pos < n:
            child = node.children.get(tuple(tokens[pos:pos + ps]))
            if child is None:
                child = TreeNode(tuple(tokens[pos:]), list(pages[pos // ps:]), node, n)
                self.allocator.incref(child.pages)
                node.children[child.key[:ps]] = child
                self._count_new(child)
                node, pos = child, n
                break
            k = self._matching_pages(child.key, tokens, pos)
            if k < len(child.pages):
                child = self._split(child, k)
            node, pos = child, pos + len(child.key)
        if state is not None and node.state is None:
            node.state = state
            self.num_states += 1
            self.state_bytes += state.nbytes
        self._touch(node)
        return node

    def find_tail(self, node: TreeNode, tokens: Sequence[int]) -> Optional[TreeNode]:
        """The tail of exactly `tokens` past `node`'s end, touched, or None."""
        tail = node.children.get(tuple(tokens)) if 0 < len(tokens) < self.page_size else None
        if tail is not None:
            self._touch(tail)
        return tail

    def insert_tail(self, node: TreeNode, tokens: Sequence[int], page: int, state: ResumeState) -> TreeNode:
        """Cache `tokens` (fewer than a page) past `node`'s end, in the first part of `page`, with
        the resume state after them: a tail leaf (the existing one when the tree has these
        tokens there already). The tree takes a hold on the page it adopts."""
        key = tuple(tokens)
        if not 0 < len(key) < self.page_size:
            raise ValueError(f"a tail holds 1..{self.page_size - 1} tokens, got {len(key)}")
        if state.length != node.end + len(key):
            raise ValueError(f"resume state after {state.length} tokens cannot end a tail at {node.end + len(key)}")
        tail = node.children.get(key)
        if tail is None:
            self.version += 1
            tail = TreeNode(key, [page], node, state.length)
            self.allocator.incref(tail.pages)
            node.children[key] = tail
            node.num_tails += 1
            tail.state = state
            self._count_new(tail)
            self.num_states += 1
            self.state_bytes += state.nbytes
        self._touch(tail)
        return tail

    # ---- locks and eviction ----------------------------------------------------------

    def lock(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_pages -= len(node.pages)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref <= 0:
                raise AssertionError("unlock of a prefix-cache node that is not locked")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_pages += len(node.pages)
            node = node.parent

    def evict(self, num_pages: int) -> int:
        """Free at least `num_pages` pages by dropping unlocked leaves, least recently used
        first (fewer when not enough is unlocked). Returns the pages freed."""
        return self._evict_lru(lambda freed: freed >= num_pages)

    def trim_states(self, max_bytes: int) -> int:
        """Drop unlocked leaves, least recently used first, until the resume states take at
        most `max_bytes` (or nothing unlocked is left). Returns the pages freed."""
        return self._evict_lru(lambda freed: self.state_bytes <= max_bytes)

    def _evict_lru(self, done) -> int:
        heap = [(n.last_access, id(n), n) for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while not done(freed) and heap:
            _, _, node = heapq.heappop(heap)
            self.version += 1
            parent = node.parent
            del parent.children[node.key[:self.page_size]]
            if len(node.key) < self.page_size:
                parent.num_tails -= 1
            freed += self.allocator.free(node.pages)
            self.cached_pages -= len(node.pages)
            self.cached_tokens -= len(node.key)
            self.evictable_pages -= len(node.pages)
            self.evicted_pages += len(node.pages)
            self.num_nodes -= 1
            if node.state is not None:
                self.num_states -= 1
                self.state_bytes -= node.state.nbytes
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def reset(self) -> int:
        """Drop every unlocked node; returns the pages freed."""
        return self.evict(self.cached_pages)

    # ---- introspection ---------------------------------------------------------------

    def nodes(self) -> List[TreeNode]:
        out, stack = [], list(self.root.children.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def held_pages(self) -> List[int]:
        """Every page the tree holds (each exactly once when the tree is consistent)."""
        return [p for n in self.nodes() for p in n.pages]

    # ---- internals -------------------------------------------------------------------

    def _count_new(self, node: TreeNode) -> None:
        self.cached_pages += len(node.pages)
        self.cached_tokens += len(node.key)
        self.evictable_pages += len(node.pages)
        self.num_nodes += 1

    def _longest_tail(self, node: TreeNode, tokens: Sequence[int], pos: int, max_len: int) -> Optional[TreeNode]:
        """The longest tail of `node` that `tokens` continue with, ending by max_len."""
        if not node.num_tails:
            return None
        for r in range(min(self.page_size - 1, max_len - pos, len(tokens) - pos), 0, -1):
            tail = node.children.get(tuple(tokens[pos:pos + r]))
            if tail is not None:
                return tail
        return None

    def _leaves(self) -> List[TreeNode]:
        return [n for n in self.nodes() if not n.children]

    def _touch(self, node: TreeNode) -> None:
        self._clock += 1
        while node is not None:
            node.last_access = self._clock
            node = node.parent

    def _matching_pages(self, key: tuple, tokens: Sequence[int], pos: int) -> int:
        ps = self.page_size
        k = 0
        while (k + 1) * ps <= len(key) and pos + (k + 1) * ps <= len(tokens) and \
                tuple(tokens[pos + k * ps:pos + (k + 1) * ps]) == key[k * ps:(k + 1) * ps]:
            k += 1
        return k

    def _split(self, child: TreeNode, k: int) -> TreeNode:
        """Cut `child`'s edge after k pages; the new upper node has no resume state."""
        ps = self.page_size
        parent = child.parent
        upper = TreeNode(child.key[:k * ps], child.pages[:k], parent, child.end - len(child.key) + k * ps)
        upper.lock_ref = child.lock_ref  # every lock below counts on it too
        upper.last_access = child.last_access
        parent.children[upper.key[:ps]] = upper
        child.key, child.pages, child.parent = child.key[k * ps:], child.pages[k:], upper
        upper.children[child.key[:ps]] = child
        self.num_nodes += 1
        return upper
