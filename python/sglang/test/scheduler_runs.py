"""Serving a list of requests to completion through a real Scheduler, for tests."""

from __future__ import annotations

from sglang.test.kv_accounting import assert_no_request_holds_kv


def serve_all(sched, reqs, draft_override=None):
    """Add `reqs` to `sched` (with speculation, `draft_override` drives its drafts), step it
    until it has no work and check that no request holds KV. Returns ({rid: (token ids,
    logprobs)}, the scheduler's stats)."""
    if draft_override is not None:
        sched.speculator.draft_override = draft_override
    for r in reqs:
        sched.add_request(r)
    res = {}
    while sched.has_work():
        for o in sched.step():
            ids, lps = res.get(o.rid, ([], []))
            res[o.rid] = (ids + o.new_token_ids, lps + (o.new_logprobs or []))
    assert_no_request_holds_kv(sched)
    return res, sched.get_stats()
