"""Where a step's transient device memory goes at DeepSeek-V4-Flash dims (one GPU).

    python benchmark/memory/flash_memory_probe.py --num-layers 2 --num-tokens 64 1024 4096

Builds Flash with a few layers, release format, dummy weights and a small KV pool, then runs
one eager mixed step per token count and reports, per module of the first layers, the peak
bytes allocated above what was allocated when the module was entered. The memory planner's
activation reserve (planning/memory_planner.py) is checked against these numbers. Then the
breakable graphs are captured for the same buckets and their pool size is reported.
Prints one JSON line per result.
"""

from __future__ import annotations

import argparse
import json

import torch

from sglang.bench_one_batch_steps import make_batch
from sglang.srt.configs.loader import load_model_config
from sglang.srt.planning.memory_planner import GiB, attention_break_bytes, segment_activation_bytes
from sglang.srt.model_executor.graph_dispatch import eager_path
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.server_args import ServerArgs

MiB = 2**20


def module_peaks(model, layers: int):
    """Hooks that record, per module, peak allocated bytes above the bytes at its entry."""
    peaks, entry, handles = {}, {}, []

    def pre(name):
        def hook(mod, args):
            torch.cuda.synchronize()
            entry[name] = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        return hook

    def post(name):
        def hook(mod, args, out):
            torch.cuda.synchronize()
            peaks[name] = max(peaks.get(name, 0), torch.cuda.max_memory_allocated() - entry[name])
        return hook

    for i in range(layers):
        layer = model.layers[i]
        for child in ("attn", "ffn", "hc_attn", "hc_ffn"):
            name = f"layers.{i}.{child}"
            mod = getattr(layer, child)
            handles += [mod.register_forward_pre_hook(pre(name)), mod.register_forward_hook(post(name))]
        for sub in ("compressor", "indexer", "wo_b", "wq_b"):
            if getattr(layer.attn, sub, None) is not None:
                name = f"layers.{i}.attn.{sub}"
                mod = getattr(layer.attn, sub)
                handles += [mod.register_forward_pre_hook(pre(name)), mod.register_forward_hook(post(name))]
    return peaks, handles


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--num-tokens", type=int, nargs="+", default=[64, 1024, 4096])
    p.add_argument("--prefix", type=int, default=1024)
    p.add_argument("--capture", action="store_true", help="also capture breakable graphs for these buckets")
    a = p.parse_args(argv)
    max_tokens = max(a.num_tokens)
    n_reqs = 2 * (max_tokens // 1024 + 32 + 2)
    args = ServerArgs(
        model_path="dsv4-flash", load_format="dummy", num_layers=a.num_layers, device="cuda", dtype="bfloat16",
        context_length=8192, max_running_requests=n_reqs, max_total_tokens=n_reqs * (a.prefix + 1024 + 128),
        enable_breakable_cuda_graph=a.capture, breakable_cuda_graph_tokens=sorted(set(a.num_tokens)),
        breakable_cuda_graph_max_tokens=max_tokens, disable_cuda_graph=True).resolve(cuda_available=True)
    torch.cuda.reset_peak_memory_stats()
    runner = ModelRunner(args)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    print(json.dumps(dict(what="resident", num_layers=a.num_layers, allocated_gib=round(base / GiB, 3),
                          build_peak_gib=round(torch.cuda.max_memory_allocated() / GiB, 3),
                          kv_pool_gib=round(runner.kv_pool.nbytes() / GiB, 3),
                          bcg_graph_memory_gib=round(runner.breakable_runner.graph_memory_bytes / GiB, 3)
                          if runner.breakable_runner else None)), flush=True)
    config = load_model_config("dsv4-flash", a.num_layers)
    for n in a.num_tokens:
        fb, slots = make_batch(runner, "mixed", n, a.prefix, 1024, min(32, n // 2))
        with torch.inference_mode():
            runner.forward(fb, eager_path(fb))  # warm-up: JIT and autotune caches
            torch.cuda.synchronize()
            peaks, handles = module_peaks(runner.model, min(a.num_layers, 4))
            start = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            runner.forward(fb, eager_path(fb))
            torch.cuda.synchronize()
            step_peak = torch.cuda.max_memory_allocated() - start
            for h in handles:
                h.remove()
            # the hooks reset the peak: one more step without them for the whole-step figure
            torch.cuda.reset_peak_memory_stats()
            runner.forward(fb, eager_path(fb))
            torch.cuda.synchronize()
            step_peak = torch.cuda.max_memory_allocated() - start
        print(json.dumps(dict(
            what="eager_step", tokens=n, step_peak_mib=round(step_peak / MiB),
            planned_segment_mib=round(segment_activation_bytes(config, n, 1, len(slots)) / MiB),
            planned_break_mib=round(attention_break_bytes(config, n, 8192) / MiB),
            module_peak_mib={k: round(v / MiB) for k, v in sorted(peaks.items())})), flush=True)
        for s in slots:
            runner.req_to_token_pool.free_req(s)
    runner.shutdown()


if __name__ == "__main__":
    main()
