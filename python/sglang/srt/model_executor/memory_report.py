"""What the model runner logs about its device memory: its KV capacity, this GPU's plan beside
what it actually allocated at start-up, what is resident before graph capture, and the start-up
error for a capture that runs out of memory (the plan itself: planning/memory_planner.py)."""

from __future__ import annotations

import logging
import math
from typing import Dict, Optional

import torch

from sglang.srt.planning.memory_planner import (
    GiB,
    MemoryPlan,
    MemoryPlanError,
    PlanSettings,
    loaded_weight_format,
    plan_memory,
)

logger = logging.getLogger(__name__)


def log_memory_plan(plan: MemoryPlan, rank: int = 0, measured: Optional[Dict[str, int]] = None) -> None:
    """Start-up log line per GPU: the plan, then what was actually allocated where known."""
    logger.info("memory plan (GPU of DP rank %d): %s", rank, plan.describe())
    if measured:
        logger.info("memory measured (GPU of DP rank %d): %s", rank,
                    ", ".join(f"{k} {v / GiB:.2f} GiB" for k, v in measured.items()))


def report_kv_capacity(runner) -> dict:
    """The KV cache's size in the terms a user sizes a deployment by, logged once at start-up
    and kept in the runner's stats (/get_server_info): its dtype, bytes per token (whole bytes,
    rounded up), capacity in tokens (pages the allocator hands out: --max-total-tokens), how many
    requests of the full context length that holds, and the running-request limit."""
    args = runner.server_args
    capacity = {
        "kv_cache_dtype": args.kv_cache_dtype,
        "kv_bytes_per_token": math.ceil(runner.kv_pool.bytes_per_token()),
        "kv_capacity_tokens": args.max_total_tokens,
        "kv_capacity_requests": args.max_total_tokens // runner.max_context_len,
    }
    rank = runner.dp_groups.dp_rank if runner.dp_groups is not None else 0
    dtype = args.kv_cache_dtype if args.kv_cache_dtype != "auto" else f"{args.dtype} (auto)"
    logger.info("KV cache (DP rank %d): %s, %d B/token, %d tokens (%d requests of %d tokens), "
                "max running requests %d", rank, dtype, capacity["kv_bytes_per_token"],
                capacity["kv_capacity_tokens"], capacity["kv_capacity_requests"], runner.max_context_len,
                args.max_running_requests)
    return capacity


def _resident_bytes(runner) -> tuple[int, int]:
    tensors = list(runner.model.parameters()) + list(runner.model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors), runner.kv_pool.nbytes()


def report_startup_memory(runner, free_before: Optional[int]) -> Optional[MemoryPlan]:
    """Log this GPU's plan (from the free memory measured before the model was loaded) beside
    what the runner actually allocated. A plan that does not fit is logged as a warning here:
    ServerArgs.resolve() is where start-up refuses, before any rank loads weights."""
    cfg = runner.server_args
    weights, kv = _resident_bytes(runner)
    measured = {"weights": weights, "kv_pool": kv,
                "graph_pool": sum(r.graph_memory_bytes for r in runner.graph_runners.values())}
    rank = runner.dp_groups.dp_rank if runner.dp_groups is not None else 0
    if free_before is None:  # no GPU: nothing to divide
        logger.info("memory (DP rank %d, %s): %s", rank, runner.device,
                    ", ".join(f"{k} {v / GiB:.3f} GiB" for k, v in measured.items()))
        return None
    dtype = str(runner.dtype).removeprefix("torch.")
    settings = PlanSettings(
        weight_format=loaded_weight_format(runner.config, dtype), model_dtype=dtype,
        quant_numerics=cfg.quant_numerics, kv_cache_dtype=cfg.kv_cache_dtype, dp_size=cfg.dp_size, page_size=cfg.page_size,
        context_length=runner.max_context_len, max_running_requests=cfg.max_running_requests,
        # no chunking (-1): a whole prompt, up to the context length, is one step
        chunked_prefill_size=cfg.chunked_prefill_size if (cfg.chunked_prefill_size or 0) > 0 else runner.max_context_len,
        breakable_max_tokens=runner.breakable_runner.buckets[-1] if runner.breakable_runner else 0,
        decode_graph_max_bs=runner.decode_graph_runner.buckets[-1] if runner.decode_graph_runner else 0,
        mem_fraction_static=cfg.mem_fraction_static, max_total_tokens=cfg.max_total_tokens,
        mtp_layers=runner.num_mtp_layers, moe_backend=cfg.moe_backend,
    )
    try:
        plan = plan_memory(runner.config, settings, free_before)
    except MemoryPlanError as e:
        logger.warning("memory plan (GPU of DP rank %d) does not fit: %s", rank, e)
        return None
    if runner.device.type == "cuda":
        measured["free_now"] = torch.cuda.mem_get_info(runner.device)[0]
    log_memory_plan(plan, rank, measured)
    return plan


def log_memory_before_capture(runner) -> None:
    """What is resident before any graph is captured: if a capture then runs out of memory,
    this line says how the device was already divided (the plan's numbers are estimates)."""
    weights, kv = _resident_bytes(runner)
    free = ""
    if runner.device.type == "cuda":
        free = f", free {torch.cuda.mem_get_info(runner.device)[0] / GiB:.2f} GiB"
    logger.info("memory before graph capture: weights %.2f GiB, KV pool %.2f GiB%s", weights / GiB, kv / GiB, free)


def capture_oom_error(runner, graph_runner) -> MemoryPlanError:
    """The start-up error for a graph capture that ran out of device memory: which graph, how the
    memory was divided, and the flags that leave more room for activations and graphs."""
    weights, kv = _resident_bytes(runner)
    cfg = runner.server_args
    breakable = graph_runner.buckets_are_tokens
    what = (f"the {graph_runner.capturing}-token breakable graph" if breakable
            else f"the batch-size-{graph_runner.capturing} decode graph")
    flag = (f"--breakable-cuda-graph-max-tokens (largest bucket now {graph_runner.buckets[-1]})" if breakable
            else f"--cuda-graph-max-bs (now {graph_runner.buckets[-1]})")
    used = ""
    if runner.device.type == "cuda":
        used = (f", {torch.cuda.memory_allocated(runner.device) / GiB:.2f} GiB allocated, "
                f"{torch.cuda.mem_get_info(runner.device)[0] / GiB:.2f} GiB free")
    return MemoryPlanError(
        f"out of device memory while capturing {what} (weights {weights / GiB:.2f} GiB, KV pool "
        f"{kv / GiB:.2f} GiB{used}): the step's activations did not fit beside the KV pool. Lower "
        f"--mem-fraction-static (now {cfg.mem_fraction_static}) or --max-total-tokens to shrink the KV "
        f"pool, or lower {flag}.")
