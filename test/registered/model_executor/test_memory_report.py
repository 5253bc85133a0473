"""The runner's memory report: this GPU's plan from its own graph runners beside what it
allocated, and a graph capture that runs out of memory refused at start-up with the flags."""

import dataclasses
import math

import pytest
import torch

from sglang.srt.model_executor.graph_runner import GraphRunner
from sglang.srt.model_executor.memory_report import report_startup_memory
from sglang.srt.mem_cache.dsv4_kv_pool import kv_bytes_per_token
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.planning.memory_planner import GiB, MemoryPlanError, PlanSettings, loaded_weight_format, plan_memory
from sglang.test.runner_args import cpu_server_args

# A CUDA server's defaults with breakable graphs on; each test replaces what its runner sets.
SERVING = PlanSettings(weight_format="release", quant_numerics="release", kv_cache_dtype="auto", dp_size=1, page_size=128,
                       context_length=65536, max_running_requests=256, chunked_prefill_size=2048,
                       breakable_max_tokens=4096, decode_graph_max_bs=256, mem_fraction_static=0.8, max_total_tokens=None,
                       moe_backend="triton")


def test_startup_report_plans_from_the_runners_own_graphs(caplog):
    """report_startup_memory (called by ModelRunner on CUDA) reads the graph runners' largest
    buckets and measured graph memory; here on CPU with emulated graphs and a stated free size."""
    runner = ModelRunner(cpu_server_args(
        model_path="dsv4-tiny", context_length=256, max_running_requests=4, max_total_tokens=1024,
        enable_breakable_cuda_graph=True, breakable_cuda_graph_tokens=[8, 32], cuda_graph_max_bs=4,
        chunked_prefill_size=64), cuda_graph_on_cpu=True)
    try:
        with caplog.at_level("INFO", logger="sglang.srt.model_executor.memory_report"):
            plan = report_startup_memory(runner, free_before=8 * GiB)
        assert plan is not None and plan.free_memory == 8 * GiB
        expected = plan_memory(runner.config, dataclasses.replace(
            SERVING, weight_format=loaded_weight_format(runner.config, "float32"), model_dtype="float32",
            context_length=runner.max_context_len, max_running_requests=4, chunked_prefill_size=64, breakable_max_tokens=32,
            decode_graph_max_bs=4, max_total_tokens=1024), 8 * GiB)
        assert plan.graph_pool == expected.graph_pool and plan.activation_reserve == expected.activation_reserve
        assert "memory measured" in caplog.text and "graph_pool" in caplog.text
    finally:
        runner.shutdown()


def test_a_capture_out_of_memory_names_the_graph_and_the_flags(monkeypatch, caplog):
    """Start-up, never mid-serving: a graph capture that runs out of device memory fails with
    the bucket that did not fit, how memory was divided, and the flags that leave more room."""
    real = GraphRunner._capture_one

    def capture_one(self, bucket, pool):
        if self.buckets_are_tokens and bucket == 32:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 448.00 MiB.")
        return real(self, bucket, pool)

    monkeypatch.setattr(GraphRunner, "_capture_one", capture_one)
    cfg = cpu_server_args(model_path="dsv4-tiny", context_length=256, max_running_requests=4, max_total_tokens=1024,
                          enable_breakable_cuda_graph=True, breakable_cuda_graph_tokens=[8, 32])
    with caplog.at_level("INFO", logger="sglang.srt.model_executor.memory_report"):
        with pytest.raises(MemoryPlanError) as err:
            ModelRunner(cfg)
    msg = str(err.value)
    assert "the 32-token breakable graph" in msg and "KV pool" in msg
    assert "--mem-fraction-static (now 0.8)" in msg and "--breakable-cuda-graph-max-tokens (largest bucket now 32)" in msg
    assert isinstance(err.value.__cause__, torch.OutOfMemoryError)
    assert "memory before graph capture: weights" in caplog.text


def test_startup_logs_the_kv_capacity_and_stats_report_it(caplog):
    """One start-up line says what the KV cache holds: dtype, bytes per token, capacity in tokens
    and in requests of the context length, and the running-request limit; the runner's stats
    (hence /get_server_info) carry the same numbers."""
    with caplog.at_level("INFO", logger="sglang.srt.model_executor.memory_report"):
        runner = ModelRunner(cpu_server_args(model_path="dsv4-tiny-fp8", context_length=256, max_running_requests=3,
                                             max_total_tokens=1024))
    bpt = runner.kv_pool.bytes_per_token()
    assert bpt == kv_bytes_per_token(runner.config, torch.float32, "fp8_e4m3", index_keys_fp4=True)
    line = (f"KV cache (DP rank 0): fp8_e4m3, {math.ceil(bpt)} B/token, 1024 tokens (4 requests of 256 tokens), "
            f"max running requests 3")
    assert line in caplog.text
    stats = runner.get_stats()
    assert {k: stats[k] for k in ("kv_cache_dtype", "kv_bytes_per_token", "kv_capacity_tokens", "kv_capacity_requests")} \
        == {"kv_cache_dtype": "fp8_e4m3", "kv_bytes_per_token": math.ceil(bpt), "kv_capacity_tokens": 1024,
            "kv_capacity_requests": 4}
    caplog.clear()
    with caplog.at_level("INFO", logger="sglang.srt.model_executor.memory_report"):
        ModelRunner(cpu_server_args(model_path="dsv4-tiny", context_length=256, max_running_requests=3,
                                    max_total_tokens=1024))
    assert "KV cache (DP rank 0): float32 (auto), " in caplog.text
