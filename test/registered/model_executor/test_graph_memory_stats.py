"""Graph memory and capture time per bucket (GraphRunner.capture): one entry per bucket, in
capture order (largest first), summing to the runner's totals; on CPU, where there is no
graph pool, the memory figures are zeros."""

import logging

import pytest
import torch

from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.test.runner_args import cpu_server_args


def _check_per_bucket(stats: dict, prefix: str, buckets: list) -> None:
    memory, seconds = stats[f"{prefix}_graph_memory_by_bucket"], stats[f"{prefix}_capture_seconds_by_bucket"]
    assert list(memory) == list(seconds) == [str(b) for b in sorted(buckets, reverse=True)]
    assert sum(memory.values()) == stats[f"{prefix}_graph_memory_bytes"]
    assert all(s > 0 for s in seconds.values())
    assert sum(seconds.values()) == pytest.approx(stats[f"{prefix}_capture_seconds"], abs=1e-3 * len(buckets))


def test_per_bucket_capture_stats_on_cpu(caplog):
    with caplog.at_level(logging.INFO, logger="sglang.srt.model_executor.graph_runner"):
        runner = ModelRunner(cpu_server_args(num_layers=2, context_length=256, max_total_tokens=1024,
                                             max_running_requests=4, enable_breakable_cuda_graph=True,
                                             breakable_cuda_graph_tokens=[4, 16], cuda_graph_max_bs=2),
                             cuda_graph_on_cpu=True)
    try:
        stats = runner.get_stats()
        _check_per_bucket(stats, "breakable", [4, 16])
        _check_per_bucket(stats, "decode_graph", [1, 2])
        # no graph pool on CPU: zeros, not errors
        assert stats["breakable_graph_memory_by_bucket"] == {"16": 0, "4": 0} and stats["breakable_graph_memory_bytes"] == 0
        assert stats["decode_graph_graph_memory_by_bucket"] == {"2": 0, "1": 0}
        line = next(r.getMessage() for r in caplog.records if "breakable graphs" in r.getMessage())
        assert "per bucket, largest first: 16: 0.0 MiB" in line and ", 4: 0.0 MiB" in line
    finally:
        runner.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_largest_bucket_holds_most_of_the_graph_pool_on_dsv4_mini():
    """Captured first, the largest bucket's graph allocates the pool; the smaller ones reuse
    its blocks (weak break arguments, breakable_cuda_graph/intermediates.py) and add little."""
    buckets = [64, 256, 1024]
    runner = ModelRunner(cpu_server_args(
        model_path="dsv4-mini", device="cuda", dtype="bfloat16", context_length=2048, max_total_tokens=96 * 1024,
        max_running_requests=12, enable_breakable_cuda_graph=True, breakable_cuda_graph_tokens=buckets,
        breakable_cuda_graph_max_tokens=max(buckets), disable_cuda_graph=True))
    try:
        stats = runner.get_stats()
        _check_per_bucket(stats, "breakable", buckets)
        memory = stats["breakable_graph_memory_by_bucket"]
        total = stats["breakable_graph_memory_bytes"]
        print(f"[graph pool by bucket, MiB] { {b: round(n / 2**20, 1) for b, n in memory.items()} } "
              f"total {total / 2**20:.1f} MiB")
        assert total > 0
        assert memory["1024"] > total / 2, memory
    finally:
        runner.shutdown()
        torch.cuda.empty_cache()
