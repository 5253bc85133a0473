"""Overlap scheduling under DP attention on CPU (2 gloo ranks, dsv4-tiny, graphs on the
emulator): the consensus for step N+1 runs before step N is processed, yet every rank takes
the same path every step, the idle rank still joins, and outputs equal those without overlap."""

import pytest

from sglang.test.dp_harness import dp_scheduler_rank_main, run_ranks


def _run(tmp_path, **kw):
    return run_ranks(dp_scheduler_rank_main, 2, str(tmp_path), join_timeout_s=300, **kw)


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("dp_overlap"))


def test_dp_outputs_and_paths_are_the_same_with_and_without_overlap(first_run):
    for rank in range(2):
        on, off = first_run[rank][True], first_run[rank][False]
        assert on["results"] == off["results"]
        assert all(len(ids) == (12 if rank == 0 else 3) for ids, _ in on["results"].values())
        assert on["free_pages"][0] == on["free_pages"][1]  # every page back (free, or cached alone)
    assert len(first_run[0][True]["results"]) == 5 and len(first_run[1][True]["results"]) == 1
    for overlap in (True, False):
        # every rank agreed on every step's path (DPStepSync also checks it, one step late)
        assert first_run[0][overlap]["paths"] == first_run[1][overlap]["paths"]
        assert first_run[1][overlap]["idle_forwards"] > 0  # rank 1 idle, still joining
    assert first_run[0][True]["overlap_steps"] > 0 and first_run[1][True]["overlap_steps"] >= 0


def test_dp_stop_tokens_with_overlap_drop_the_extra_token_on_every_rank(first_run, tmp_path):
    # stop rank 0's r2 and rank 1's r0 on their 3rd / 2nd greedy token
    stops = {"rank0-r2": first_run[0][False]["results"]["rank0-r2"][0][2],
             "rank1-r0": first_run[1][False]["results"]["rank1-r0"][0][1]}
    run = _run(tmp_path, stop_token_of=stops)
    for rank, rid in ((0, "rank0-r2"), (1, "rank1-r0")):
        on, off = run[rank][True], run[rank][False]
        assert on["results"] == off["results"]
        ids, reason = on["results"][rid]
        expect = first_run[rank][False]["results"][rid][0]
        assert ids == expect[: expect.index(stops[rid]) + 1] and reason["type"] == "stop"
        assert run[0][True]["paths"] == run[1][True]["paths"]
    assert run[0][True]["dropped"] + run[1][True]["dropped"] >= 1
