"""DP attention on 2 GPUs (marker multi_gpu): NCCL collectives inside real CUDA graphs, the
same random schedule as the CPU test, outputs equal to one eager process (float32)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from sglang.test.dp_harness import dp_rank_main, eager_reference
from sglang.test.server_process import free_port

pytestmark = [pytest.mark.multi_gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]


@pytest.mark.parametrize("idle_policy", ["replay", "eager"])
def test_dp2_nccl_real_graphs_equal_one_eager_process(tmp_path, idle_policy):
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    steps = 400
    port = free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=dp_rank_main, args=(r, 2, port, steps, 11, idle_policy, str(tmp_path)),
                         kwargs=dict(device="cuda", timeout_s=120)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=900)
    assert all(not p.is_alive() for p in procs), "a DP rank hung"
    for r in range(2):
        err = tmp_path / f"rank{r}.err"
        assert not err.exists(), err.read_text()
        res = torch.load(tmp_path / f"rank{r}.pt", weights_only=False)
        by_path = {}
        worst = eager_reference(11, r, steps, res["records"], by_path, device="cuda")
        replayed = res["paths"].get("BREAKABLE", 0) + res["paths"].get("DECODE_GRAPH", 0)
        live = sum(v for k, v in res["paths"].items() if k != "IDLE")
        print(f"\nrank {r} policy {idle_policy}: paths {res['paths']} replayed {replayed / live:.1%} "
              f"max|diff| {worst:.2e} by path {by_path}")
        assert worst < 1e-3
