"""Cache-aware DP routing without processes: the router's per-rank prefix trees (page keys,
matching, bounded size, eviction order), the balance rule (the holder of the longest prefix
unless it is too far ahead of the least loaded rank; no holder: least loaded), the option's
resolution (auto -> cache_aware with prefix caching and DP > 1) and its argument rules."""

import pytest

from sglang.srt.managers.dp.controller import DataParallelController
from sglang.srt.managers.dp.prefix_tree import RankPrefixTree, block_keys
from sglang.srt.managers.dp.router import DPRouter
from sglang.srt.managers.io_struct import WAKE, GenerateReqInput, TokenOut
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs
from sglang.srt.server_args_cli import prepare_server_args

P = 4  # a small page keeps the prompts readable


def _ids(seed: int, n: int) -> list:
    return [(seed * 31 + 7 * i) % 997 + 3 for i in range(n)]


def _req(rid: str, ids: list, max_new_tokens: int = 8) -> GenerateReqInput:
    return GenerateReqInput(rid=rid, input_ids=list(ids), sampling_params=SamplingParams(max_new_tokens=max_new_tokens))


def _done(rid: str) -> TokenOut:
    return TokenOut(rid=rid, new_token_ids=[5], finished=True, finish_reason={"type": "length", "length": 1},
                    prompt_tokens=4, completion_tokens=1)


# ---- the tree ------------------------------------------------------------------------------


def test_block_keys_name_whole_pages_by_their_whole_prefix():
    a = _ids(1, 10)
    keys = block_keys(a, P)
    assert len(keys) == 2  # 10 tokens: two whole pages, the last 2 tokens have no key
    assert block_keys(a[:8], P) == keys and block_keys(a[:11], P) == keys
    assert block_keys(a[:3], P) == []
    # the same page after another first page is another key: keys stand for whole prefixes
    b = _ids(2, 4) + a[4:8]
    assert block_keys(b, P)[1] != keys[1]
    # a change in the first page changes every key after it
    c = [a[0] + 1] + a[1:]
    assert all(x != y for x, y in zip(block_keys(c, P), keys))


def test_match_counts_leading_pages_and_stops_at_the_first_missing_one():
    t = RankPrefixTree(100)
    shared = _ids(1, 12)
    t.insert(block_keys(shared + _ids(2, 8), P))
    assert t.match(block_keys(shared + _ids(3, 8), P)) == 3
    assert t.match(block_keys(shared + _ids(2, 8), P)) == 5
    assert t.match(block_keys(_ids(4, 20), P)) == 0
    assert t.match([]) == 0
    assert len(t) == 5
    t.insert(block_keys(shared + _ids(3, 8), P))  # shares 3 pages: 2 new ones
    assert len(t) == 7


def test_the_tree_is_bounded_and_forgets_the_least_recently_sent_prefix_leaf_first():
    t = RankPrefixTree(6)
    a, b, c = (block_keys(_ids(s, 3 * P), P) for s in (1, 2, 3))
    t.insert(a)
    t.insert(b)
    assert len(t) == 6
    t.insert(a)  # a is now the most recent
    t.insert(c[:1])  # one more page: b's deepest page goes, not its root, not a's
    assert len(t) == 6
    assert (t.match(a), t.match(b), t.match(c)) == (3, 2, 1)
    t.insert(c)  # two more: b's remaining pages go, leaf first
    assert (t.match(a), t.match(b), t.match(c)) == (3, 0, 3)
    with pytest.raises(ValueError, match="at least one page"):
        RankPrefixTree(0)


# ---- the balance rule ----------------------------------------------------------------------


def _router(dp_size=2, max_imbalance=2, tree_tokens=1 << 16) -> DPRouter:
    return DPRouter(dp_size, "cache_aware", page_size=P, max_imbalance=max_imbalance, tree_tokens=tree_tokens)


def test_a_repeated_prefix_goes_to_the_rank_that_was_sent_it():
    r = _router()
    shared = _ids(1, 3 * P)
    assert r.assign(_req("a", shared + _ids(2, 5))) == 0
    assert r.assign(_req("b", _ids(3, 20))) == 1  # unrelated: least loaded
    r.on_outputs([_done("a"), _done("b")])
    # rotation alone would now pick rank 0 then 1: the prefix decides instead
    assert r.assign(_req("c", _ids(4, 20))) == 0
    assert r.assign(_req("d", shared + _ids(5, 3))) == 0  # rank 0 holds 3 pages, rank 1 none
    assert r.cache_routed == 1
    # a longer held prefix beats a shorter one
    assert r.assign(_req("e", _ids(3, 16) + _ids(6, 9))) == 1  # b's first 4 pages are on rank 1
    assert r.cache_routed == 2


def test_the_holder_is_chosen_until_it_is_more_than_max_imbalance_requests_ahead():
    r = _router(max_imbalance=2)
    shared = _ids(1, 4 * P)
    ranks = [r.assign(_req(f"s{i}", shared + _ids(10 + i, 6))) for i in range(6)]
    # 0 first (idle, no holder); then rank 0 holds the prefix while it is at most 2 requests
    # ahead; then rank 1 gets one and holds the prefix too, and ties go to the less loaded
    assert ranks == [0, 0, 0, 1, 1, 1]
    assert [x.reqs for x in r.load] == [3, 3]
    assert r.cache_routed == 4


def test_max_imbalance_zero_routes_by_prefix_only_among_the_least_loaded():
    r = _router(max_imbalance=0)
    shared = _ids(1, 2 * P)
    assert r.assign(_req("a", shared + [9])) == 0
    assert r.assign(_req("b", shared + [9])) == 1  # rank 0 holds it but is 1 request ahead
    r.on_outputs([_done("a")])
    assert r.assign(_req("c", shared + [9])) == 0  # both hold it: the less loaded


def test_unrelated_prompts_spread_by_load_like_least_loaded():
    cache = _router(dp_size=3)
    least = DPRouter(3, "least_loaded")
    prompts = [_ids(100 + i, 9 + i) for i in range(12)]
    got, want = [], []
    for i, ids in enumerate(prompts):
        got.append(cache.assign(_req(f"r{i}", ids, max_new_tokens=i)))
        want.append(least.assign(_req(f"r{i}", ids, max_new_tokens=i)))
        if i % 3 == 2:  # some finish
            cache.on_outputs([_done(f"r{i - 1}")])
            least.on_outputs([_done(f"r{i - 1}")])
    assert got == want
    assert sorted(set(got)) == [0, 1, 2] and cache.cache_routed == 0


def test_a_rank_never_serves_a_whole_prompt_so_its_last_page_does_not_count():
    r = _router(max_imbalance=8)
    page_exact = _ids(1, 2 * P)
    assert r.assign(_req("a", page_exact)) == 0
    r.on_outputs([_done("a")])
    # same prompt again: only its first page is usable, and rank 0 holds it
    assert r.assign(_req("b", page_exact)) == 0 and r.cache_routed == 1
    r.on_outputs([_done("b")])
    one_page = _ids(2, P)
    assert r.assign(_req("c", one_page)) == 1  # rotation
    r.on_outputs([_done("c")])
    assert r.assign(_req("d", one_page)) == 0  # nothing usable: rotation, not rank 1
    assert r.cache_routed == 1


def test_wakes_and_release_work_as_with_the_other_methods():
    r = _router(dp_size=3)
    a, b = _req("a", _ids(1, 9)), _req("b", _ids(1, 9))
    assert r.route(a) == [(0, a), (1, WAKE), (2, WAKE)]
    assert r.route(b) == [(0, b)]  # outstanding work: no wakes; rank 0 holds its 2 pages
    r.on_outputs([_done("a"), _done("b")])
    assert r.num_outstanding == 0 and [(x.reqs, x.tokens) for x in r.load] == [(0, 0)] * 3
    d = _req("d", _ids(1, 9))
    assert r.route(d) == [(0, d), (1, WAKE), (2, WAKE)]


def test_set_tree_tokens_bounds_every_rank_in_pages():
    r = _router(tree_tokens=1 << 16)
    r.set_tree_tokens(3 * P + 1)
    assert [t.capacity_blocks for t in r.trees] == [3, 3]
    r.assign(_req("a", _ids(1, 8 * P)))
    assert len(r.trees[0]) == 3 and len(r.trees[1]) == 0


# ---- the option ----------------------------------------------------------------------------

DP2 = dict(enable_dp_attention=True, dp_size=2)


def test_auto_is_cache_aware_with_prefix_caching_and_dp_else_round_robin():
    def method(**kw):
        return DataParallelController(ServerArgs(**kw)).router.method

    assert method(**DP2, enable_prefix_caching=True) == "cache_aware"
    assert method(**DP2) == "cache_aware"  # prefix caching is on by default
    assert method(**DP2, disable_radix_cache=True) == "round_robin"
    assert method(**DP2, enable_prefix_caching=False) == "round_robin"
    assert method(enable_prefix_caching=True) == "round_robin"
    assert method(**DP2, enable_prefix_caching=True, load_balance_method="least_loaded") == "least_loaded"
    resolved = ServerArgs(**DP2, enable_prefix_caching=True).resolve(cuda_available=False)
    assert resolved.load_balance_method == "cache_aware"
    assert ServerArgs(**DP2).resolve(cuda_available=False).load_balance_method == "cache_aware"
    assert ServerArgs(**DP2, disable_radix_cache=True).resolve(cuda_available=False).load_balance_method \
        == "round_robin"
    router = DataParallelController(ServerArgs(**DP2, enable_prefix_caching=True, page_size=256,
                                               load_balance_max_imbalance=7)).router
    assert (router.page_size, router.max_imbalance) == (256, 7)


def test_cache_aware_needs_prefix_caching_and_a_sane_imbalance():
    with pytest.raises(ValueError, match="cache_aware .* needs prefix caching, which --disable-radix-cache turns off"):
        ServerArgs(**DP2, load_balance_method="cache_aware", disable_radix_cache=True)
    with pytest.raises(ValueError, match="cache_aware .* needs prefix caching"):
        ServerArgs(**DP2, load_balance_method="cache_aware", enable_prefix_caching=False)
    assert ServerArgs(**DP2, load_balance_method="cache_aware").load_balance_method == "cache_aware"
    with pytest.raises(ValueError, match="--load-balance-max-imbalance must be an integer >= 0"):
        ServerArgs(**DP2, load_balance_max_imbalance=-1)
    a = prepare_server_args(["--enable-dp-attention", "--dp-size", "2", "--enable-prefix-caching",
                             "--load-balance-method", "cache_aware", "--load-balance-max-imbalance", "3"])
    assert (a.load_balance_method, a.load_balance_max_imbalance) == ("cache_aware", 3)
    with pytest.raises(SystemExit):
        prepare_server_args(["--load-balance-method", "prefix"])
    with pytest.raises(ValueError, match="unknown load balance method"):
        DPRouter(2, "auto")
