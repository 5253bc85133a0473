"""DP attention with breakable graphs, 2 gloo processes on CPU: random batches with idle
ranks and graph-ineligible batches for 1000 steps, no hang, outputs equal to one process
run eagerly; the consensus is a pure function; a rank that disagrees fails loudly."""

from __future__ import annotations

import random

import pytest
import torch
import torch.multiprocessing as mp

from sglang.srt.model_executor.graph_dispatch import GraphTables, PathKind, StepInfo, decide_step_path
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.test.dp_harness import dp_rank_main, eager_reference
from sglang.test.server_process import free_port

STEPS = 1000
SEED = 7


def _run_ranks(tmp_path, steps, idle_policy, **kw):
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=dp_rank_main, args=(r, 2, port, steps, SEED, idle_policy, str(tmp_path)), kwargs=kw)
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=600)
    assert all(not p.is_alive() for p in procs), "a DP rank hung"
    out = {}
    for r in range(2):
        err = tmp_path / f"rank{r}.err"
        out[r] = err.read_text() if err.exists() else torch.load(tmp_path / f"rank{r}.pt", weights_only=False)
    return out


@pytest.fixture(scope="module")
def replay_policy_run(tmp_path_factory):
    return _run_ranks(tmp_path_factory.mktemp("dp_replay"), STEPS, "replay")


def test_1000_steps_no_hang_and_equal_to_one_eager_process(replay_policy_run):
    for rank in range(2):
        result = replay_policy_run[rank]
        assert not isinstance(result, str), result
        paths = result["paths"]
        assert sum(paths.values()) == STEPS
        assert paths.get("BREAKABLE", 0) > 200 and paths.get("EAGER", 0) > 20 and paths.get("DECODE_GRAPH", 0) > 0
        worst = eager_reference(SEED, rank, STEPS, result["records"])
        assert worst < 1e-4, f"rank {rank}: max |logit diff| vs one eager process = {worst}"


def test_idle_policies_give_the_same_live_outputs(tmp_path, replay_policy_run):
    steps = 200
    eager_run = _run_ranks(tmp_path, steps, "eager")
    for rank in range(2):
        assert not isinstance(eager_run[rank], str), eager_run[rank]
        replayed = {r.step: r for r in replay_policy_run[rank]["records"] if r.step < steps}
        compared = 0
        for rec in eager_run[rank]["records"]:
            torch.testing.assert_close(rec.logits, replayed[rec.step].logits, rtol=0, atol=1e-4)
            assert torch.equal(rec.logits.argmax(-1), replayed[rec.step].logits.argmax(-1))
            compared += 1
        assert compared > 100
    # With the eager policy, no step that had an idle rank replayed a graph.
    assert eager_run[0]["paths"].get("BREAKABLE", 0) < replay_policy_run[0]["paths"]["BREAKABLE"]


def test_a_rank_that_disagrees_fails_with_a_clear_error(tmp_path):
    result = _run_ranks(tmp_path, 60, "replay", verify=True, disagree_at=40, timeout_s=30)
    for rank in range(2):
        text = result[rank]
        assert isinstance(text, str), f"rank {rank} finished although the ranks disagreed"
        assert "DPConsensusError: DP ranks disagree on the step path at step 40: " in text, text[-800:]
        last = text.strip().splitlines()[-1]
        named = last.split("at step 40: ", 1)[1].split("; ", 1)[0]
        taken = dict(part.split(" -> ") for part in named.split(", "))
        assert set(taken) == {"rank 0", "rank 1"} and taken["rank 0"] != taken["rank 1"], last


# ---- the consensus function --------------------------------------------------------------

CFG = GraphTables(breakable_buckets=(8, 16, 32, 48), decode_bs_buckets=(1, 2, 4, 8), idle_policy="replay")
MODES = [ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.MIXED, ForwardMode.IDLE]


def _random_info(rng):
    mode = rng.choice(MODES)
    if mode == ForwardMode.IDLE:
        return StepInfo(0, int(mode), 0)
    n = rng.randint(1, 80)
    return StepInfo(n, int(mode), rng.randint(1, min(n, 12)), has_input_embeds=rng.random() < 0.2)


def test_consensus_is_the_same_on_every_rank_for_any_vector():
    rng = random.Random(0)
    for _ in range(3000):
        infos = [_random_info(rng) for _ in range(rng.randint(1, 8))]
        for cfg in (CFG, GraphTables(CFG.breakable_buckets, CFG.decode_bs_buckets, "eager")):
            decisions = set()
            for rank in range(len(infos)):
                # one answer from N calls on the same vector: no hidden state, no mutation of
                # the vector (ranks with different inputs: test_dp_consensus.py)
                decisions.add(decide_step_path(list(infos), cfg))
            assert len(decisions) == 1
            path = decisions.pop()
            live = [i for i in infos if not i.idle]
            if not live:
                assert path.kind == PathKind.IDLE
            elif path.kind == PathKind.BREAKABLE:
                n = max(i.num_tokens for i in infos)
                assert n <= path.size <= 3 * n  # the padding-waste rule holds under DP too
                assert not (cfg.idle_policy == "eager" and len(live) < len(infos))
            elif path.kind == PathKind.DECODE_GRAPH:
                assert all(i.mode == ForwardMode.DECODE and not i.has_input_embeds for i in live)
                assert path.size >= max(i.batch_size for i in live)
            else:
                assert path.kind == PathKind.EAGER and path.reason


def test_consensus_examples():
    e = lambda n: StepInfo(n, int(ForwardMode.EXTEND), 1)  # noqa: E731
    d = lambda bs, embeds=False: StepInfo(bs, int(ForwardMode.DECODE), bs, embeds)  # noqa: E731
    idle = StepInfo(0, int(ForwardMode.IDLE), 0)
    assert decide_step_path([e(10), e(30)], CFG).size == 32  # bucket from the largest rank
    assert decide_step_path([d(3), d(5, embeds=True)], CFG).reason == "input_embeds"
    assert decide_step_path([e(49), e(3)], CFG).kind == PathKind.EAGER  # beyond the largest bucket
    assert decide_step_path([e(20), idle], CFG).kind == PathKind.BREAKABLE  # idle rank replays
    assert decide_step_path([e(20), idle], GraphTables(CFG.breakable_buckets, (), "eager")).reason == "inactive_dp_rank"
    assert decide_step_path([d(3), d(5)], CFG) .kind == PathKind.DECODE_GRAPH
    assert decide_step_path([d(3), d(5)], CFG).size == 8
    assert decide_step_path([d(3), e(20)], CFG).kind == PathKind.BREAKABLE  # decode rows ride along
    assert decide_step_path([idle, idle], CFG).kind == PathKind.IDLE
