"""MTP speculative decoding under DP attention on CPU (2 gloo ranks, DeepSeek's conformance
checkpoint, breakable graphs on the emulator): rank 1 is idle for most steps and still joins
the target's and every MTP forward (their MoE is collective); no hang; outputs equal plain
decoding on every rank with the MTP layer's drafts and with partly accepted ones."""

import os
from pathlib import Path

import torch
import torch.multiprocessing as mp

from sglang.test.dp_harness import dp_speculative_rank_main
from sglang.test.server_process import free_port

CKPT = str(Path(os.environ.get("DSV4_REFERENCE_DIR") or Path(__file__).parents[2] / "data" / "dsv4-reference")
           / "conformance-tiny")


def test_dp_ranks_speculate_in_step_and_match_plain_decoding(tmp_path):
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=dp_speculative_rank_main, args=(r, 2, port, str(tmp_path), CKPT)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=400)
    assert all(not p.is_alive() for p in procs), "a DP rank hung"
    out = {}
    for r in range(2):
        err = tmp_path / f"rank{r}.err"
        assert not err.exists(), err.read_text() if err.exists() else ""
        out[r] = torch.load(tmp_path / f"rank{r}.pt", weights_only=False)
    for rank in range(2):
        plain = out[rank]["plain"]
        assert len(plain["results"]) == (5 if rank == 0 else 1)
        for name in ("mtp", "partial"):
            run = out[rank][name]
            assert run["results"] == plain["results"], (rank, name)
            assert run["free_pages"][0] == run["free_pages"][1]  # every page back
    for name in ("plain", "mtp", "partial"):
        assert out[0][name]["paths"] == out[1][name]["paths"]  # the same path every step
        assert out[1][name]["idle_forwards"] > 0  # rank 1 idle, still joining
    partial = out[0]["partial"]["spec"]
    assert 0 < partial["spec_accepted_tokens"] < partial["spec_draft_tokens"]
    assert out[0]["partial"]["breakable_replays"] > 0
