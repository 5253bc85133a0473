"""The prefix cache's radix tree and the page counts it shares with requests: page-granular
match and insert (matches end only at nodes with a resume state), tails (part of a page past
a node, matched by the longest one within the limit), locks that keep nodes in
use from eviction, LRU eviction of unlocked leaves asked for by the pool before an
allocation fails, and a seeded fuzz of 2,000 operations holding every invariant:
free + held-by-requests + cached-only = pool, every page's count = its holders, no page held
twice by the tree or by one request, lock counts = the locks taken at or below each node."""

import random

import pytest
import torch

from sglang.srt.mem_cache.allocator import KVCacheExhausted, RefCountedPageAllocator
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.mem_cache.req_to_token_pool import ReqToTokenPool
from sglang.srt.mem_cache.resume_state import ResumeState

P = 128


def _pool(num_pages=17, max_num_reqs=4):
    return ReqToTokenPool(max_num_reqs, 16 * P, num_pages, P, "cpu")


def _seq(*pages):
    """Tokens of whole pages, page k all equal to pages[k]."""
    return [t for p in pages for t in [p] * P]


def _request(pool, tokens):
    slot = pool.alloc_req()
    pool.ensure_capacity(slot, len(tokens))
    return slot


# ---- allocator ---------------------------------------------------------------------------


def test_a_shared_page_is_freed_by_its_last_holder_only():
    a = RefCountedPageAllocator(4, first=1)
    p = a.alloc(2)
    a.incref([p[0]])
    assert a.free(p) == 1 and a.num_free == 3 and a.refcount(p[0]) == 1
    assert a.free([p[0]]) == 1 and a.num_free == 4
    with pytest.raises(ValueError, match="double free"):
        a.free([p[0]])
    with pytest.raises(ValueError, match="free or foreign"):
        a.incref([p[0]])
    with pytest.raises(KVCacheExhausted, match="need 5, 4 free"):
        a.alloc(5)


# ---- match and insert --------------------------------------------------------------------


def test_match_ends_at_the_deepest_node_with_a_state_and_never_reaches_max_len():
    pool = _pool()
    tree = RadixCache(pool.pages, P)
    toks = _seq(1, 2, 3)
    slot = _request(pool, toks)
    pages = pool.pages_of(slot)
    tree.insert(toks[:P], pages[:1], ResumeState(P))
    tree.insert(toks, pages, ResumeState(3 * P))
    assert [pool.pages.refcount(p) for p in pages] == [2, 2, 2]
    m = tree.match_prefix(toks + [9], max_len=3 * P)
    assert (m.length, m.pages, m.state.length) == (3 * P, pages, 3 * P)
    # the whole prompt is never matched: the limit (len - 1) stops at the earlier state
    m = tree.match_prefix(toks, max_len=3 * P - 1)
    assert (m.length, m.pages) == (P, pages[:1])
    # a different third page: the edge splits nowhere on match, the state at 1 page serves
    m = tree.match_prefix(_seq(1, 2, 7, 7), max_len=4 * P)
    assert m.length == P
    # a page differing in its last token does not match it
    other = _seq(1, 2)
    other[-1] = 99
    assert tree.match_prefix(other + [5], max_len=2 * P + 1).length == P
    assert tree.match_prefix(_seq(5, 1, 2, 3), max_len=4 * P).length == 0


def test_insert_splits_at_page_boundaries_and_keeps_the_trees_pages_for_known_positions():
    pool = _pool()
    tree = RadixCache(pool.pages, P)
    a = _seq(1, 2, 3)
    sa = _request(pool, a)
    tree.insert(a, pool.pages_of(sa), ResumeState(3 * P))
    b = _seq(1, 2, 4, 5)
    sb = _request(pool, b)
    node = tree.insert(b, pool.pages_of(sb), ResumeState(4 * P))
    assert node.end == 4 * P and tree.num_nodes == 3  # [1,2] split off, [3] and [4,5] below it
    held = tree.held_pages()
    assert sorted(held) == sorted(pool.pages_of(sa) + pool.pages_of(sb)[2:])
    # b's first two pages duplicate a's: the tree did not take them
    assert [pool.pages.refcount(p) for p in pool.pages_of(sb)] == [1, 1, 2, 2]
    # the split node [1, 2] got no state: a match there cannot resume
    assert tree.match_prefix(_seq(1, 2, 9), max_len=3 * P).length == 0
    assert tree.match_prefix(b + [0], max_len=4 * P).pages == pool.pages_of(sa)[:2] + pool.pages_of(sb)[2:]
    with pytest.raises(ValueError, match="whole pages"):
        tree.insert(a[:P + 1], pool.pages_of(sa)[:2], None)
    with pytest.raises(ValueError, match="cannot end"):
        tree.insert(a[:P], pool.pages_of(sa)[:1], ResumeState(2 * P))


# ---- locks and eviction ------------------------------------------------------------------


def test_a_match_ends_in_the_longest_tail_within_the_limit():
    pool = _pool()
    tree = RadixCache(pool.pages, P)
    toks = _seq(1, 2) + list(range(10, 50))
    slot = _request(pool, toks)
    pages = pool.pages_of(slot)
    node = tree.insert(toks[:2 * P], pages[:2], ResumeState(2 * P))
    short = tree.insert_tail(node, toks[2 * P:2 * P + 5], pages[2], ResumeState(2 * P + 5))
    long = tree.insert_tail(node, toks[2 * P:], pages[2], ResumeState(2 * P + 40))
    assert pool.pages.refcount(pages[2]) == 3 and tree.cached_pages == 4 and tree.cached_tokens == 2 * P + 45
    m = tree.match_prefix(toks + [7], max_len=len(toks))
    assert (m.node, m.length, m.state.length) == (long, 2 * P + 40, 2 * P + 40)
    assert m.pages == pages and m.shared_pages(P) == pages[:2] and m.tail_page(P) == pages[2]
    # the limit (a prompt's length - 1) drops the longer tail; a token off inside both, the page state
    assert tree.match_prefix(toks, max_len=len(toks) - 1).node is short
    off = list(toks)
    off[2 * P + 3] = 99
    m = tree.match_prefix(off, max_len=len(off))
    assert (m.node, m.length, m.tail_page(P)) == (node, 2 * P, None)
    assert tree.find_tail(node, toks[2 * P:]) is long and tree.find_tail(node, toks[2 * P:-1]) is None
    # the same tokens again: the tree keeps its tail and takes no second hold
    assert tree.insert_tail(node, toks[2 * P:], pages[3 % len(pages)], ResumeState(2 * P + 40)) is long
    assert pool.pages.refcount(pages[2]) == 3
    with pytest.raises(ValueError, match="1..127 tokens"):
        tree.insert_tail(node, _seq(3), pages[2], ResumeState(3 * P))
    with pytest.raises(ValueError, match="cannot end a tail"):
        tree.insert_tail(node, [5], pages[2], ResumeState(2 * P))


def test_a_tail_is_a_leaf_evicted_before_the_node_it_hangs_off():
    pool = _pool()
    tree = RadixCache(pool.pages, P)
    toks = _seq(1) + [4] * 9
    slot, other = _request(pool, toks), _request(pool, [4] * 3)
    pages = pool.pages_of(slot)
    node = tree.insert(toks[:P], pages[:1], ResumeState(P))
    tail = tree.insert_tail(node, toks[P:], pages[1], ResumeState(P + 9))
    tree.insert_tail(tree.root, [4] * 3, pool.pages_of(other)[0], ResumeState(3))  # a tail off the root
    pool.free_req(slot)
    pool.free_req(other)
    assert tree.evictable_pages == 3 and pool.num_free_pages == pool.pages.capacity - 3
    tree.lock(tail)  # a tail in use keeps its page and the node it hangs off
    assert tree.evict(3) == 1 and tree.num_nodes == 2  # only the root's tail could go
    tree.unlock(tail)
    assert tree.evict(1) == 1 and node.num_tails == 0 and tree.num_nodes == 1
    assert tree.evict(1) == 1 and tree.num_nodes == 0 and tree.cached_tokens == 0
    assert pool.num_free_pages == pool.pages.capacity


def test_states_past_their_budget_evict_the_least_recently_used_unlocked_prefixes():
    pool = _pool()
    tree = RadixCache(pool.pages, P)
    state = lambda n: ResumeState(n, window=torch.zeros(1000, dtype=torch.uint8))  # noqa: E731
    nodes = []
    for first in (1, 2, 3, 4):
        toks = _seq(first) + [5] * 3
        slot = _request(pool, toks)
        pages = pool.pages_of(slot)
        nodes.append(tree.insert(toks[:P], pages[:1], state(P)))
        nodes.append(tree.insert_tail(nodes[-1], toks[P:], pages[1], state(P + 3)))
        pool.free_req(slot)
    assert tree.state_bytes == 8000 and tree.num_states == 8
    tree.lock(nodes[1])  # the oldest session's tail is in use
    tree.match_prefix(_seq(2) + [5] * 4, max_len=P + 3)  # the second session's tail is the newest
    freed = tree.trim_states(4500)
    assert tree.state_bytes == 4000 and freed == 4
    # left: the locked tail and its node, the touched session (node and tail)
    assert {n.end for n in tree.nodes()} == {P, P + 3} and tree.num_nodes == 4
    assert all(any(n is m for m in tree.nodes()) for n in (nodes[0], nodes[1], nodes[2], nodes[3]))
    assert tree.trim_states(0) == 2 and tree.state_bytes == 2000  # a locked prefix never goes
    tree.unlock(nodes[1])


def test_eviction_frees_unlocked_leaves_in_lru_order_and_never_a_node_in_use():
    pool = _pool(num_pages=7)  # 6 usable pages
    tree = RadixCache(pool.pages, P)
    pool.reclaimer = tree.evict
    nodes = {}
    for name, toks in (("x", _seq(1, 2)), ("y", _seq(3, 4)), ("z", _seq(5, 6))):
        s = _request(pool, toks)
        nodes[name] = tree.insert(toks, pool.pages_of(s), ResumeState(2 * P))
        pool.free_req(s)  # finished: only the tree holds its pages
    assert pool.num_free_pages == 0 and tree.evictable_pages == 6
    tree.match_prefix(_seq(1, 2, 0), max_len=2 * P + 1)  # x used last
    tree.lock(nodes["y"])  # y in use
    s = pool.alloc_req()
    pool.ensure_capacity(s, 2 * P)  # the pool asks the tree: z (least recent, unlocked) goes
    assert tree.match_prefix(_seq(5, 6, 0), max_len=3 * P).length == 0
    assert tree.match_prefix(_seq(3, 4, 0), max_len=3 * P).length == 2 * P
    with pytest.raises(KVCacheExhausted):
        pool.ensure_capacity(s, 5 * P)  # x goes, y is locked: 1 page short, nothing allocated
    assert tree.match_prefix(_seq(3, 4, 0), max_len=3 * P).length == 2 * P
    assert len(pool.pages_of(s)) == 2
    tree.unlock(nodes["y"])
    pool.ensure_capacity(s, 5 * P)
    assert tree.cached_pages == 0 and tree.num_nodes == 0 and pool.num_free_pages == 1
    with pytest.raises(AssertionError, match="not locked"):
        tree.unlock(nodes["y"])


def test_an_evicted_leaf_exposes_its_parent_for_eviction():
    pool = _pool()
    tree = RadixCache(pool.pages, P)
    a, b = _seq(1, 2), _seq(1, 3)
    for toks in (a, b):
        s = _request(pool, toks)
        tree.insert(toks, pool.pages_of(s), ResumeState(2 * P))
        pool.free_req(s)
    assert tree.num_nodes == 3 and tree.cached_pages == 3
    assert tree.evict(3) == 3
    assert tree.num_nodes == 0 and pool.num_free_pages == pool.pages.capacity


# ---- fuzz --------------------------------------------------------------------------------


class _World:
    """Requests over a pool and a tree, with the bookkeeping the invariants are checked against."""

    def __init__(self, rng):
        self.rng = rng
        self.pool = ReqToTokenPool(6, 8 * P, 25, P, "cpu")
        self.tree = RadixCache(self.pool.pages, P)
        self.pool.reclaimer = self.tree.evict
        self.reqs = {}  # slot -> (tokens, locked node or None)
        self.extra_locks = []  # nodes locked by readers other than requests
        self.tail_hits = 0
        self.finished = []  # token lists of finished requests short enough to continue
        self.counts = {}

    def tokens(self):
        if self.finished and self.rng.random() < 0.3:  # a next turn: continues a finished request
            prev = self.rng.choice(self.finished)
            return prev + [self.rng.randrange(1, 9) for _ in range(self.rng.randrange(1, P))]
        stem = self.rng.choice([(1, 2, 3, 4), (1, 2, 5, 6), (7, 8, 9, 1)])
        k = self.rng.randrange(0, 5)
        pages = list(stem[:k]) + [self.rng.randrange(1, 4) for _ in range(self.rng.randrange(0, 3))]
        return _seq(*pages) + [self.rng.randrange(1, 9) for _ in range(self.rng.randrange(1, P))]

    def op(self, name):
        self.counts[name] = self.counts.get(name, 0) + 1
        getattr(self, name)()

    def add(self):
        if self.pool.slots.num_free == 0:
            return
        toks = self.tokens()
        m = self.tree.match_prefix(toks, max_len=len(toks) - 1)
        if m.length:
            self.tree.lock(m.node)
        slot = self.pool.alloc_req()
        self.pool.map_cached_prefix(slot, m.shared_pages(P))  # a tail's page: the request's own copy
        try:
            self.pool.ensure_capacity(slot, len(toks))
        except KVCacheExhausted:  # a failed request leaks nothing
            if m.length:
                self.tree.unlock(m.node)
            self.pool.free_req(slot)
            return
        self.reqs[slot] = (toks, m.node if m.length else None)
        self.tail_hits += m.tail_page(P) is not None

    def match(self):
        toks = self.tokens()
        m = self.tree.match_prefix(toks, max_len=self.rng.randrange(0, len(toks)))
        assert m.length <= len(toks)
        if m.length:
            assert m.state.length == m.length and len(m.pages) == -(-m.length // P)
            assert m.tail_page(P) == (m.pages[-1] if m.length % P else None)

    def lock(self):
        nodes = self.tree.nodes()
        if nodes:
            n = self.rng.choice(nodes)
            self.tree.lock(n)
            self.extra_locks.append(n)

    def unlock(self):
        if self.extra_locks:
            self.tree.unlock(self.extra_locks.pop(self.rng.randrange(len(self.extra_locks))))

    def _end(self, insert):
        if not self.reqs:
            return
        slot = self.rng.choice(sorted(self.reqs))
        toks, node = self.reqs.pop(slot)
        if insert:
            if len(toks) < 6 * P:
                self.finished = (self.finished + [toks])[-8:]
            L = len(toks) // P * P
            new = self.tree.insert(toks[:L], self.pool.pages_of(slot)[: L // P], ResumeState(L)) if L else None
            if len(toks) % P and self.rng.random() < 0.5:  # and the tokens past the last boundary
                new = self.tree.insert_tail(new or self.tree.root, toks[L:], self.pool.pages_of(slot)[L // P],
                                            ResumeState(len(toks)))
            if new is not None:
                self.tree.lock(new)
                if node is not None:
                    self.tree.unlock(node)
                node = new
        if node is not None:
            self.tree.unlock(node)
        self.pool.free_req(slot)

    def finish(self):
        self._end(insert=True)

    def abort(self):
        self._end(insert=False)

    def evict(self):
        locked = [n for n in self.tree.nodes() if n.lock_ref > 0]
        want = self.rng.randrange(1, 6)
        before = self.pool.num_free_pages
        freed = self.tree.evict(want)
        assert self.pool.num_free_pages == before + freed
        alive = set(map(id, self.tree.nodes()))
        assert all(id(n) in alive for n in locked), "a node in use was evicted"

    def check(self):
        pool, tree = self.pool, self.tree
        held_by_tree = tree.held_pages()
        assert len(held_by_tree) == len(set(held_by_tree)), "a page held twice by the tree"
        by_reqs = {}
        for slot in self.reqs:
            pages = pool.pages_of(slot)
            assert len(pages) == len(set(pages)), "a page twice in one page table"
            for p in pages:
                by_reqs[p] = by_reqs.get(p, 0) + 1
        for p in range(1, pool.pages.capacity + 1):
            assert pool.pages.refcount(p) == by_reqs.get(p, 0) + held_by_tree.count(p) >= 0
        cached_only = set(held_by_tree) - set(by_reqs)
        assert pool.num_free_pages + len(by_reqs) + len(cached_only) == pool.pages.capacity
        # lock counts: every request's node and every reader's lock, counted on all ancestors
        expect = {}
        for n in [node for _, node in self.reqs.values() if node is not None] + self.extra_locks:
            while n is not tree.root:
                expect[id(n)] = expect.get(id(n), 0) + 1
                n = n.parent
        nodes = tree.nodes()
        assert all(n.lock_ref == expect.get(id(n), 0) for n in nodes)
        assert tree.evictable_pages == sum(len(n.pages) for n in nodes if n.lock_ref == 0)
        assert tree.cached_pages == len(held_by_tree) and tree.num_nodes == len(nodes)
        # an unlocked node's pages are the tree's alone (so evicting it frees them)
        assert all(pool.pages.refcount(p) == 1 for n in nodes if n.lock_ref == 0 for p in n.pages)
        for n in nodes:
            tail = len(n.pages) == 1 and 0 < len(n.key) < P and not n.children and n.state is not None
            assert (len(n.key) == len(n.pages) * P or tail) and n.end == n.parent.end + len(n.key)
        assert tree.cached_tokens == sum(len(n.key) for n in nodes)
        assert all(n.num_tails == sum(len(c.key) < P for c in n.children.values()) for n in nodes + [tree.root])


def test_seeded_fuzz_of_2000_operations_keeps_every_invariant():
    rng = random.Random(1234)
    w = _World(rng)
    ops = ["add"] * 5 + ["match"] * 2 + ["lock", "unlock", "evict"] + ["finish"] * 3 + ["abort"]
    for _ in range(2000):
        w.op(rng.choice(ops))
        w.check()
    assert min(w.counts.values()) >= 100, w.counts  # every kind of operation ran many times
    assert w.tree.evicted_pages > 0 and w.tree.num_nodes > 0 and w.tail_hits > 10
    while w.reqs:
        w.abort()
    while w.extra_locks:
        w.unlock()
    w.check()
    w.tree.reset()
    assert w.pool.num_free_pages == w.pool.pages.capacity and w.tree.cached_pages == 0
