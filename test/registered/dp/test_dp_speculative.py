"""MTP speculative decoding under DP attention on CPU (2 gloo ranks, DeepSeek's conformance
checkpoint, breakable graphs on the emulator): rank 1 is idle for most steps and still joins
the target's and every MTP forward (their MoE is collective); no hang; outputs equal plain
decoding on every rank with the MTP layer's drafts and with partly accepted ones."""

import os
from pathlib import Path

from sglang.test.dp_harness import dp_speculative_rank_main, run_ranks

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
    partial = out[0]["partial"]["spec"]
    assert 0 < partial["spec_accepted_tokens"] < partial["spec_draft_tokens"]
    assert out[0]["partial"]["breakable_replays"] > 0
