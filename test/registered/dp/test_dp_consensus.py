"""DP consensus with ranks whose inputs differ, 2 gloo processes on CPU (dsv4-tiny, BCG
buckets 8/16/32/48, decode graphs 1/2/4/8): every rank takes the path `decide_step_path`
gives for all ranks' descriptions, never the one its own batch alone would give; a
rank-dependent decision (debug check) and ranks with different idle policies (always-on
check) each fail on every rank with a `DPConsensusError` naming both ranks' paths, before any
model collective; different buckets fail at start-up, before capture. In every case the
processes pass a barrier afterwards and exit cleanly."""

from __future__ import annotations

import torch
import torch.multiprocessing as mp

from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.model_executor.graph_dispatch import GraphTables, PathKind, StepInfo, decide_step_path
from sglang.test.dp_harness import BUCKETS, dp_scripted_rank_main, script_infos
from sglang.test.server_process import free_port

TABLES = GraphTables(breakable_buckets=BUCKETS, decode_bs_buckets=(1, 2, 4, 8), idle_policy="replay")
IDLE = ([], False)

# Per step: (rank 0, rank 1), each (rows [(request, new tokens)], input embeds). The comment
# says what the step needs to agree on, and what rank 0 or 1 would pick from its own batch.
SCRIPT = [
    (([(0, 10)], False), ([(0, 30)], False)),  # breakable/32: largest rank's bucket (r0 alone: breakable/16)
    (([(0, 1)], False), ([(1, 20)], False)),  # breakable/32: decode rides along (r0 alone: decode/1)
    (([(1, 20)], False), IDLE),  # breakable/32: the idle rank replays (r1 alone: idle)
    (([(0, 1), (1, 1)], False), ([(0, 1), (1, 1)], True)),  # eager: r1 has embeddings (r0 alone: decode/2)
    (([(2, 5)], False), ([(2, 60)], False)),  # eager: r1 has too many tokens (r0 alone: breakable/8)
    (IDLE, IDLE),  # idle: nobody runs a forward
    (([(0, 1), (3, 6)], False), ([(0, 1), (1, 1)], False)),  # breakable/8: r0 mixed (r1 alone: decode/2)
    (([(0, 1)], False), ([(0, 1), (1, 1), (2, 1)], False)),  # decode/4 (r0 alone: decode/1)
    (([(4, 3)], False), ([(3, 3)], False)),  # breakable/8 on both, alone too
]


def _run(tmp_path, script, timeout=120, per_rank=None, **kw):
    """Both ranks run `script` (`per_rank`: extra arguments of one rank); returns each rank's
    saved result after asserting that neither hung, crashed or exited non-zero."""
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=dp_scripted_rank_main, args=(r, 2, port, str(tmp_path), script),
                         kwargs={**kw, **(per_rank or {}).get(r, {})})
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout)
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
    assert not hung, f"DP ranks {hung} hung"
    out = {}
    for r in range(2):
        err = tmp_path / f"rank{r}.err"
        assert not err.exists(), err.read_text()
        assert procs[r].exitcode == 0, f"rank {r} exit code {procs[r].exitcode}"
        out[r] = torch.load(tmp_path / f"rank{r}.pt", weights_only=False)
    return out


def test_ranks_with_different_batches_take_the_path_of_all_ranks(tmp_path):
    expected = [script_infos(SCRIPT, r) for r in range(2)]
    # The script is only a test if a rank deciding alone would go wrong: at 7 of the 9 steps
    # one rank's own batch gives another path than both ranks' batches.
    both = [decide_step_path([expected[0][i], expected[1][i]], TABLES) for i in range(len(SCRIPT))]
    alone = [i for i in range(len(SCRIPT))
             if any(decide_step_path([expected[r][i]], TABLES).code() != both[i].code() for r in range(2))]
    assert alone == [0, 1, 2, 3, 4, 6, 7]
    result = _run(tmp_path, SCRIPT, verify=True)  # verify: the debug cross-check must not fire either
    kinds = set()
    for i in range(len(SCRIPT)):
        want = both[i]
        for r in range(2):
            assert result[r]["error"] is None, result[r]["error"]
            got = result[r]["steps"][i]
            assert got["local"] == expected[r][i], f"step {i} rank {r}: ran another batch than scripted"
            assert [(g.num_tokens, g.mode, g.batch_size, g.has_input_embeds) for g in got["gathered"]] == \
                [(e.num_tokens, e.mode, e.batch_size, e.has_input_embeds) for e in (expected[0][i], expected[1][i])]
            assert got["path"] == want, f"step {i} rank {r}: {got['path']} != {want}"
            assert got["logits_ok"]
        kinds.add((want.kind, want.reason))
    assert {(PathKind.BREAKABLE, ""), (PathKind.DECODE_GRAPH, ""), (PathKind.IDLE, ""),
            (PathKind.EAGER, "input_embeds"), (PathKind.EAGER, "too_many_tokens")} <= kinds
    # every step but the all-idle one ran a forward on both ranks (idle ranks included)
    assert result[0]["forwards"] == result[1]["forwards"] == len(SCRIPT) - 1


def test_a_rank_dependent_decision_is_caught_before_the_forward(tmp_path):
    # Step 0 (10 vs 30 tokens) is the first where deciding on the local batch differs.
    result = _run(tmp_path, SCRIPT, verify=True, local_decide=True)
    for r in range(2):
        err = result[r]["error"]
        assert err is not None, f"rank {r} ran the script although its decision was rank-dependent"
        assert err["step"] == 0 and err["forwards"] == 0, err
        assert err["text"].startswith("DP ranks disagree on the step path at step 0: rank 0 -> breakable/16, "
                                      "rank 1 -> breakable/32; the decision depends on the rank"), err["text"]


def test_different_idle_policies_fail_at_the_step_they_split_with_both_paths_named(tmp_path):
    # Rank 1 runs the eager idle policy. Step 0 has no idle rank and runs; at step 1 rank 1 is
    # idle: rank 0's tables say breakable/16, rank 1's say eager. No verify: this check is always on.
    script = [(([(0, 10)], False), ([(0, 12)], False)),
              (([(1, 10)], False), IDLE),
              (([(2, 4)], False), ([(2, 4)], False))]
    result = _run(tmp_path, script, timeout=90, per_rank={1: dict(idle_policy="eager")})
    for r in range(2):
        err = result[r]["error"]
        assert err is not None, f"rank {r} ran on although the idle policies differ"
        assert err["step"] == 1 and err["forwards"] == 1, err  # step 0 ran; step 1 entered no collective
        assert err["text"].startswith("DP ranks disagree on the step path at step 1: rank 0 -> breakable/16, "
                                      "rank 1 -> eager/10 (inactive_dp_rank); the ranks' graph tables differ"), err["text"]
        assert "idle policy replay" in err["text"] and "idle policy eager" in err["text"]
        assert [s["path"].code() for s in result[r]["steps"]] == [PathKind.BREAKABLE * 1_000_000 + 16]


def test_different_graph_buckets_fail_at_start_up_naming_both_ranks(tmp_path):
    # Capture itself runs the MoE collectives once per bucket, so the buckets are compared
    # before it: without that, rank 0 captures a fourth bucket alone and gloo aborts.
    result = _run(tmp_path, SCRIPT[:1], timeout=90, per_rank={1: dict(buckets=(8, 16, 32))})
    for r in range(2):
        err = result[r]["error"]
        assert err is not None and err["step"] is None and not result[r]["steps"], err
        assert err["text"].startswith("DP ranks have different graph buckets (rank 0: breakable (8, 16, 32, 48), "
                                      "decode (1, 2, 4, 8); rank 1: breakable (8, 16, 32), decode (1, 2, 4, 8))"), err["text"]


def test_different_idle_policies_disagree_only_on_steps_with_an_idle_rank():
    """The pure part of the always-on check: the paths under each rank's tables."""
    t0, t1 = (GraphTables(BUCKETS, (1, 2, 4, 8), p) for p in ("replay", "eager"))
    busy = [StepInfo(20, int(ForwardMode.EXTEND), 1), StepInfo(9, int(ForwardMode.EXTEND), 2)]
    one_idle = [StepInfo(20, int(ForwardMode.EXTEND), 1), StepInfo(0, int(ForwardMode.IDLE), 0)]
    assert decide_step_path(busy, t0) == decide_step_path(busy, t1)
    assert decide_step_path(one_idle, t0).kind == PathKind.BREAKABLE
    assert decide_step_path(one_idle, t1).reason == "inactive_dp_rank"
