"""DeepSeek-V4-Flash dims on one H200: the memory plan, then start-up (weights, KV pool, graph
capture), with as many layers as fit (--num-layers, about 20 in the release format).

  python benchmark/memory/flash_startup.py --plan-only            # the paper plan, CPU is enough
  python benchmark/memory/flash_startup.py --num-layers 20        # on the H200

Start-up builds the model in the release format (FP8 linears, FP4 experts) on the device and
fills it with `--load-format dummy` random weights tensor by tensor (expert by expert), so no
bf16 copy of a layer ever exists; a plan that does not fit stops before anything is allocated.
Prints one JSON line per result.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import time

from sglang.srt.configs.loader import load_model_config
from sglang.srt.configs.deepseek_v4 import estimate_num_parameters
from sglang.srt.planning.memory_planner import (
    GiB,
    H200_USABLE_BYTES,
    MemoryPlanError,
    PlanSettings,
    plan_memory,
)
from sglang.srt.server_args import ServerArgs, default_kv_cache_dtype


def max_layers_that_fit(settings: PlanSettings, gpu_bytes: int) -> int:
    """Most Flash layers one GPU of `gpu_bytes` holds under `settings` (0 if none)."""
    best = 0
    for n in range(1, 44):
        try:
            plan_memory(load_model_config("dsv4-flash", n), settings, gpu_bytes)
            best = n
        except MemoryPlanError:
            break
    return best


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-layers", type=int, default=20)
    p.add_argument("--context-length", type=int, default=131072 + 4096)
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--chunked-prefill-size", type=int, default=4096)
    p.add_argument("--breakable-cuda-graph-max-tokens", type=int, default=4096)
    p.add_argument("--cuda-graph-max-bs", type=int, default=64)
    p.add_argument("--mem-fraction-static", type=float, default=0.85)
    p.add_argument("--kv-cache-dtype", default=None, choices=["auto", "fp8_e4m3"],
                   help="auto (bf16 rows) | fp8_e4m3 (584-byte rows); default: the server's (fp8_e4m3: "
                        "Flash runs the release numerics)")
    p.add_argument("--plan-only", action="store_true", help="print the plan for an H200 and stop (no GPU)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    settings = PlanSettings(
        weight_format="release", model_dtype="bfloat16", quant_numerics="release",
        kv_cache_dtype=a.kv_cache_dtype or default_kv_cache_dtype("release"),
        context_length=a.context_length, max_running_requests=a.max_running_requests,
        chunked_prefill_size=a.chunked_prefill_size, breakable_max_tokens=a.breakable_cuda_graph_max_tokens,
        decode_graph_max_bs=a.cuda_graph_max_bs, mem_fraction_static=a.mem_fraction_static,
        dp_size=1, page_size=ServerArgs.page_size, max_total_tokens=None,  # the server's page size; KV sized by the plan
        moe_backend="humming")  # what "auto" picks on an H200 with humming-kernels installed
    config = load_model_config("dsv4-flash", a.num_layers)
    print(json.dumps(dict(what="flash_config", num_layers=a.num_layers,
                          params_b=round(estimate_num_parameters(config) / 1e9, 1),
                          max_layers_on_one_h200=max_layers_that_fit(settings, H200_USABLE_BYTES))))
    try:
        plan = plan_memory(config, settings, H200_USABLE_BYTES)
        print(json.dumps(dict(what="paper_plan_h200", **{k: (round(v / GiB, 2) if isinstance(v, int) and v > GiB // 8
                                                              else v) for k, v in plan.as_dict().items()})))
    except MemoryPlanError as e:
        print(json.dumps(dict(what="paper_plan_h200", error=str(e))))
    two = dataclasses.replace(settings, dp_size=2)
    full = plan_memory(load_model_config("dsv4-flash"), two, H200_USABLE_BYTES)
    print(json.dumps(dict(what="paper_plan_43_layers_2xh200_per_gpu", weights_gib=round(full.weights / GiB, 1),
                          kv_pool_gib=round(full.kv_pool / GiB, 1), kv_tokens=full.kv_pool_tokens,
                          graph_pool_gib=round(full.graph_pool / GiB, 2), headroom_gib=round(full.headroom / GiB, 1))))
    if a.plan_only:
        return

    import torch

    from sglang.srt.model_executor.model_runner import ModelRunner

    args = ServerArgs(
        model_path="dsv4-flash", num_layers=a.num_layers, load_format="dummy", context_length=a.context_length,
        max_running_requests=a.max_running_requests, chunked_prefill_size=a.chunked_prefill_size,
        enable_breakable_cuda_graph=True, breakable_cuda_graph_max_tokens=a.breakable_cuda_graph_max_tokens,
        cuda_graph_max_bs=a.cuda_graph_max_bs, mem_fraction_static=a.mem_fraction_static,
        kv_cache_dtype=a.kv_cache_dtype,
    ).resolve(cuda_available=True)  # raises MemoryPlanError with the shortfall if it cannot fit
    start = time.perf_counter()
    runner = ModelRunner(args)
    startup = time.perf_counter() - start
    stats = runner.get_stats()
    plan = runner.memory_plan
    print(json.dumps(dict(
        what="startup_h200", num_layers=a.num_layers, startup_s=round(startup, 1),
        bcg_capture_s=stats.get("breakable_capture_seconds"), bcg_graph_memory_gib=round(stats.get("breakable_graph_memory_bytes", 0) / GiB, 2),
        bcg_capture_memory_gib=round(stats.get("breakable_capture_memory_bytes", 0) / GiB, 2),
        bcg_graph_mib_by_bucket={b: round(n / 2**20, 1) for b, n in stats.get("breakable_graph_memory_by_bucket", {}).items()},
        bcg_capture_s_by_bucket=stats.get("breakable_capture_seconds_by_bucket"),
        decode_capture_s=round(runner.decode_graph_runner.capture_seconds, 1) if runner.decode_graph_runner else None,
        max_total_tokens=args.max_total_tokens, weights_gib=round(sum(
            t.numel() * t.element_size() for t in runner.model.parameters()) / GiB, 2),
        kv_pool_gib=round(runner.kv_pool.nbytes() / GiB, 2), free_gib=round(torch.cuda.mem_get_info()[0] / GiB, 2),
        planned=plan.as_dict() if plan else None)))
    runner.shutdown()


if __name__ == "__main__":
    main()
