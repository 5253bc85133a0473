"""The scheduler's side of prefix caching (on unless --disable-radix-cache): when a request
takes a cached prefix, when its resume states are taken, and what it inserts into the radix
tree.

- Admission: the request's tokens are matched against the tree, never in full (at least one
  token is computed, for its logits). A hit maps the cached pages into the request's page
  table, writes the node's ResumeState into its state rows, locks the node and starts the
  request at the matched length: its first forward is an extend from that prefix.
- After every launched forward, a request whose computed length is a multiple of page_size
  takes its ResumeState (only the latest is kept). The scheduler cuts prefill chunks at page
  boundaries (`cut_chunk`), so a prompt leaves a state at the end of every chunk but its last
  and at its last page boundary: a prompt longer than a page always leaves one.
- Insertion: after a prefill forward that took a state (a chunk ending on a page boundary, or
  the prompt's last boundary), and when the request finishes (its decode reached later
  boundaries), the tokens up to the state's length go into the tree with their pages. While
  it runs, the request keeps the deepest node it inserted or matched locked.
- Tails: a request that finishes between boundaries (the usual case: a chat answer rarely
  ends on one) also caches the tokens past its last boundary, with a state taken at its end,
  as a tail (radix_cache.py). A later request matching it maps the whole pages before it and
  starts from a copy of its page (`DSV4KVPool.copy_page`: the compressed entries and indexer
  keys of that page), so the next turn of a chat prefills only its new message.
- Aborted and failed requests insert nothing; every request unlocks its node and drops its
  page holds when it releases its KV (finish, abort, failure, retraction).

Memory: a node that ends a cached insertion holds one ResumeState in host memory
(resume_state.py: the window's raw rows on every layer and the ratio-4 compressor rings'
last block, 3.89 MiB for DeepSeek-V4-Flash with its FP8 KV cache at any boundary past the
window; a tail's state also holds the ratio-128 rings' partial block: up to 14.4 MiB); nodes
made by splits hold none. The states' host memory is bounded (--prefix-cache-state-gb): past
it the least recently used unlocked prefixes are evicted, pages and all. Pages are the pool's
own: cached pages are evicted before anything else is refused, so caching never lowers what
the pool admits.
"""

from __future__ import annotations

import logging
from typing import Callable, Deque, List, Optional

from sglang.srt.mem_cache.radix_cache import PrefixMatch, RadixCache
from sglang.srt.mem_cache.req_to_token_pool import ReqToTokenPool
from sglang.srt.mem_cache.resume_state import restore_resume_state, take_resume_state

logger = logging.getLogger(__name__)
# --schedule-policy lpm orders at most this many waiting requests a step (order_longest_prefix_first)
LPM_MAX_WAITING = 128


class PrefixCaching:
    def __init__(self, pool: ReqToTokenPool, kv_pool, copy_page: Optional[Callable[[int, int], None]] = None,
                 state_budget_bytes: int = 8 << 30):
        """copy_page(src, dst): the runner's copy of every paged cache's page (tails need it:
        a runner without one caches whole pages only). state_budget_bytes: the host memory the
        tree's resume states may take (--prefix-cache-state-gb); past it the least recently
        used prefixes are evicted."""
        self.pool = pool
        self.kv_pool = kv_pool  # None for runners without KV pools (tests' fake runners)
        self.copy_page = copy_page
        self.state_budget_bytes = state_budget_bytes
        self.page_size = pool.page_size
        self.tree = RadixCache(pool.pages, pool.page_size)
        pool.reclaimer = self.tree.evict
        self.num_lookups = 0
        self.num_hits = 0
        self.lookup_tokens = 0  # tokens of the admitted requests
        self.hit_tokens = 0  # of those, tokens taken from the cache
        self._lpm_matches = {}  # order_longest_prefix_first's matches: id -> (req, tree version, seq_len, length)

    @property
    def evictable_pages(self) -> int:
        """Pages of unlocked nodes: no request maps them, the pool evicts them on demand."""
        return self.tree.evictable_pages

    def cache_only_pages(self) -> List[int]:
        """The pages whose only holder is the tree (what eviction could free)."""
        return [p for p in self.tree.held_pages() if self.pool.pages.refcount(p) == 1]

    # ---- admission -------------------------------------------------------------------

    def lookup(self, req) -> PrefixMatch:
        """The cached prefix a waiting request could take, locked (release with `unlock`
        when the request is not admitted after all)."""
        match = self.tree.match_prefix(req.token_slice(0, req.seq_len), max_len=req.seq_len - 1)
        if match.length:
            self.tree.lock(match.node)
        return match

    def order_longest_prefix_first(self, waiting: Deque) -> None:
        """--schedule-policy lpm: reorder the waiting queue so that the requests the tree holds
        the longest prefix of come first (a stable sort: arrival order among equal matches).
        Requests that share a long cached prefix then reuse it before eviction can take it,
        and cached chat turns are not queued behind other sessions' uncached prompts. Above
        LPM_MAX_WAITING requests the queue keeps its order: matching every one each step would
        cost more than it saves (SGLang falls back the same way)."""
        if len(waiting) < 2 or len(waiting) > LPM_MAX_WAITING:
            return
        # a request's match changes only with the tree or its own length: most steps reuse it
        known, version, length = self._lpm_matches, self.tree.version, {}
        for r in waiting:
            _, v, n, m = known.get(id(r), (None, None, None, None))
            if v != version or n != r.seq_len:
                m = self.tree.match_prefix(r.token_slice(0, r.seq_len), r.seq_len - 1, touch=False).length
            length[id(r)] = m
        # holding each request keeps its id from being reused by another while it is a key
        self._lpm_matches = {id(r): (r, version, r.seq_len, length[id(r)]) for r in waiting}
        ordered = sorted(waiting, key=lambda r: -length[id(r)])
        waiting.clear()
        waiting.extend(ordered)

    def unlock(self, match: PrefixMatch) -> None:
        if match.length:
            self.tree.unlock(match.node)

    def admit(self, req, match: PrefixMatch) -> None:
        """Start a request that just got its slot at the matched length; the lookup's lock
        becomes the request's (released by `release`)."""
        self.num_lookups += 1
        self.lookup_tokens += req.seq_len
        if not match.length:
            return
        ps = self.page_size
        self.pool.map_cached_prefix(req.req_pool_idx, match.shared_pages(ps))
        tail_page = match.tail_page(ps)
        if tail_page is not None:  # the request's own copy of the tail's page, which it fills on
            self.pool.ensure_capacity(req.req_pool_idx, match.length)
            self.copy_page(tail_page, self.pool.pages_of(req.req_pool_idx)[-1])
        restore_resume_state(self.kv_pool, req.req_pool_idx, match.state)
        req.prefix_len = match.length
        req.cache_node = match.node
        req.cached_tokens += match.length
        self.num_hits += 1
        self.hit_tokens += match.length

    def cut_chunk(self, seq_len: int, prefix_len: int, n: int) -> int:
        """A prefill chunk of n tokens from prefix_len, shortened so that it ends on a page
        boundary, where the request then takes a resume state: a chunk that leaves tokens for
        later ends at the last boundary it crosses; the final chunk stops at the last boundary
        of the seq_len tokens (the rest follows in one more forward). A chunk crossing no
        boundary stays as it is."""
        ps = self.page_size
        end = prefix_len + n
        cut = end // ps * ps if end < seq_len else seq_len // ps * ps
        return cut - prefix_len if prefix_len < cut < end else n

    # ---- after a forward -------------------------------------------------------------

    def after_forward(self, req, prefill: bool) -> None:
        """`req.prefix_len` was just advanced past this forward's tokens."""
        L = req.prefix_len
        if L % self.page_size:
            return
        req.resume_state = take_resume_state(self.kv_pool, req.req_pool_idx, L)
        if prefill:
            self._insert(req)

    def on_finish(self, req) -> None:
        """A request that finished normally caches what it computed: up to its last state, and
        past its last page boundary as a tail with the state at its end."""
        L = req.prefix_len
        locked_end = req.cache_node.end if req.cache_node is not None else 0
        tails = self.copy_page is not None
        tokens = req.token_slice(0, L) if tails and L % self.page_size and L > locked_end else None
        if tokens is None or req.req_pool_idx is None or not _known(tokens, L):
            self._insert(req)
            return
        F = L - L % self.page_size
        state = req.resume_state if req.resume_state is not None and req.resume_state.length == F else None
        pages = self.pool.pages_of(req.req_pool_idx)
        node = self.tree.insert(tokens[:F], pages[: F // self.page_size], state) if F else self.tree.root
        tail = self.tree.find_tail(node, tokens[F:])  # the same tokens cached already: no new state
        if tail is None:
            tail = self.tree.insert_tail(node, tokens[F:], pages[F // self.page_size],
                                         take_resume_state(self.kv_pool, req.req_pool_idx, L))
        self._lock_instead(req, tail)

    def release(self, req) -> None:
        """Before the request's page holds are dropped."""
        if req.cache_node is not None:
            self.tree.unlock(req.cache_node)
            self._within_budget()  # what the request's lock kept past the budget may go now
        req.cache_node = None
        req.resume_state = None

    def _insert(self, req) -> None:
        state = req.resume_state
        locked_end = req.cache_node.end if req.cache_node is not None else 0
        if state is None or state.length <= locked_end or req.req_pool_idx is None:
            return
        L = state.length
        tokens = req.token_slice(0, L)
        if not _known(tokens, L):
            return
        pages = self.pool.pages_of(req.req_pool_idx)[: L // self.page_size]
        self._lock_instead(req, self.tree.insert(tokens, pages, state))

    def _lock_instead(self, req, node) -> None:
        """The request's lock moves to `node`, which it just inserted; then the states are
        brought back within their budget (the new one is locked: never what goes)."""
        self.tree.lock(node)
        if req.cache_node is not None:
            self.tree.unlock(req.cache_node)
        req.cache_node = node
        self._within_budget()

    def _within_budget(self) -> None:
        if self.tree.state_bytes > self.state_budget_bytes:
            self.tree.trim_states(self.state_budget_bytes)

    # ---- stats -----------------------------------------------------------------------

    def get_stats(self) -> dict:
        t = self.tree
        return {
            "prefix_cache_hit_rate": self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0,
            "prefix_cache_hit_tokens": self.hit_tokens,
            "prefix_cache_lookup_tokens": self.lookup_tokens,
            "prefix_cache_hits": self.num_hits,
            "prefix_cache_lookups": self.num_lookups,
            "prefix_cache_cached_tokens": t.cached_tokens,
            "prefix_cache_cached_pages": t.cached_pages,
            "prefix_cache_evictable_pages": t.evictable_pages,
            "prefix_cache_evicted_pages": t.evicted_pages,
            "prefix_cache_nodes": t.num_nodes,
            "prefix_cache_state_bytes": t.state_bytes,
        }


def _known(tokens: List[int], length: int) -> bool:
    """Whether a request's tokens of positions [0, length) are all on the host (none in flight)."""
    return len(tokens) == length and min(tokens) >= 0


def make_prefix_caching(server_args, model_runner) -> Optional[PrefixCaching]:
    """The scheduler's prefix caching, or None when off (then the pool evicts nothing)."""
    pool = model_runner.req_to_token_pool
    if pool.reclaimer is not None:
        # a new scheduler over this runner: the pages an earlier one's cache kept would
        # otherwise stay held with nothing left to evict them
        pool.reclaimer(pool.pages.capacity)
    if not server_args.enable_prefix_caching:
        pool.reclaimer = None
        return None
    return PrefixCaching(pool, getattr(model_runner, "kv_pool", None), getattr(model_runner, "copy_kv_page", None),
                         int(server_args.prefix_cache_state_gb * (1 << 30)))
