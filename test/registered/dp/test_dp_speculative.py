"""MTP speculative decoding under DP attention on CPU (2 gloo ranks, DeepSeek's conformance
checkpoint, breakable and decode graphs on the emulator): rank 1 is idle for most steps and
still joins the target's and every MTP forward (their MoE is collective), graph replays
included; no hang; outputs equal plain decoding on every rank with the MTP layer's drafts and
with partly accepted ones."""

import os
from pathlib import Path

from sglang.test.dp_harness import dp_speculative_rank_main, run_ranks
from sglang.test.mtp_checkpoints import write_two_module_checkpoint

CKPT = str(Path(os.environ.get("DSV4_REFERENCE_DIR") or Path(__file__).parents[2] / "data" / "dsv4-reference")
           / "conformance-tiny")


def test_dp_ranks_speculate_in_step_and_match_plain_decoding(tmp_path):
    out = run_ranks(dp_speculative_rank_main, 2, str(tmp_path), CKPT)
    for rank in range(2):
        plain = out[rank]["plain"]
        assert len(plain["results"]) == (5 if rank == 0 else 1)
        for name in ("mtp", "partial"):
            run = out[rank][name]
            assert run["results"] == plain["results"], (rank, name)
            assert run["free_pages"][0] == run["free_pages"][1]  # every page back (free, or cached alone)
    for name in ("plain", "mtp", "partial"):
        assert out[0][name]["paths"] == out[1][name]["paths"]  # the same path every step
        assert out[1][name]["idle_forwards"] > 0  # rank 1 idle, still joining
    for name in ("mtp", "partial"):
        # the MTP forwards replay their graphs on both ranks (rank 1's mostly with no live row),
        # the same number of forwards and replays of each kind on both
        assert out[0][name]["forward_mtp"] == out[1][name]["forward_mtp"] > 0
        assert out[0][name]["mtp_replays"] == out[1][name]["mtp_replays"]
        assert out[0][name]["mtp_replays"]["decode_graph"] > 0 and out[0][name]["mtp_replays"]["breakable"] > 0
    partial = out[0]["partial"]["spec"]
    assert 0 < partial["spec_accepted_tokens"] < partial["spec_draft_tokens"]
    assert out[0]["partial"]["breakable_replays"] > 0


def test_dp_ranks_chain_two_mtp_modules_in_step(tmp_path):
    """A checkpoint with two MTP modules: each step both ranks run both modules' passes over
    committed positions and the draft steps' module, the idle rank with empty batches; same
    paths, same MTP forwards and replays on both; outputs equal plain decoding."""
    ckpt = write_two_module_checkpoint(CKPT, tmp_path / "ckpt")
    out = run_ranks(dp_speculative_rank_main, 2, str(tmp_path), str(ckpt))
    for rank in range(2):
        for name in ("mtp", "partial"):
            assert out[rank][name]["results"] == out[rank]["plain"]["results"], (rank, name)
    for name in ("mtp", "partial"):
        assert out[0][name]["paths"] == out[1][name]["paths"]
        assert out[0][name]["forward_mtp"] == out[1][name]["forward_mtp"] > 0
        assert out[0][name]["mtp_replays"] == out[1][name]["mtp_replays"]
        assert out[0][name]["mtp_replays"]["decode_graph"] > 0 and out[0][name]["mtp_replays"]["breakable"] > 0
    partial = out[0]["partial"]["spec"]
    assert 0 < partial["spec_accepted_tokens"] < partial["spec_draft_tokens"]


def test_dp_speculation_keeps_step_for_hundreds_of_steps(tmp_path):
    """A soak: rank 0 decodes 1200 tokens one request at a time with partly accepted drafts
    (0 to 3 accepted per step, varying with the position), rank 1 finishes two short requests
    early and then only joins. Over more than 500 steps the ranks never leave step and every
    output equals plain decoding."""
    # about 400 s on two CPU cores: a hang is what outlives twice that
    out = run_ranks(dp_speculative_rank_main, 2, str(tmp_path), CKPT, soak=True, join_timeout_s=800.0)
    for rank in range(2):
        assert out[rank]["partial"]["results"] == out[rank]["plain"]["results"], rank
        assert out[rank]["partial"]["free_pages"][0] == out[rank]["partial"]["free_pages"][1]
    assert len(out[0]["partial"]["paths"]) >= 500
    assert out[0]["partial"]["paths"] == out[1]["partial"]["paths"]
    assert out[1]["partial"]["idle_forwards"] > 400
    spec = out[0]["partial"]["spec"]
    assert 0 < spec["spec_accepted_tokens"] < spec["spec_draft_tokens"]
