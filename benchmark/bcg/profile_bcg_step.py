"""Where one extend/mixed step spends its time: host phases of a breakable-graph replay and
the GPU kernels of the same padded step.

    python benchmark/bcg/profile_bcg_step.py --model-path dsv4-mini --num-tokens 64 256 --out DIR
    python benchmark/bcg/profile_bcg_step.py --modes extend mixed --num-tokens 16 64   # both kinds

For each mode and size it prints (1) host-side time of each replay phase without syncs (what
the CPU spends enqueueing), (2) the same phases with a sync after each (GPU catches up), (3) the
top GPU kernels of one padded eager step (forward_padded_eager: the replay's exact kernels),
(4) the top host ops of one replay and (5) the GPU kernels of one replay (segments and the
eager breaks), from torch.profiler. Writes the tables under --out.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from sglang.bench_one_batch_steps import make_batch
from sglang.srt.layers.logits_processor import compute_logits
from sglang.srt.model_executor.forward_context import forward_context
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.server_args import ServerArgs


def phases(breakable, fb, sync: bool):
    """Host seconds per replay phase (sync=True: each phase waits for the GPU)."""
    t = {}
    n = fb.num_tokens
    bucket = breakable.bucket_for(n)

    def mark(name, start):
        if sync:
            torch.cuda.synchronize()
        t[name] = t.get(name, 0.0) + time.perf_counter() - start
        return time.perf_counter()

    s = time.perf_counter()
    static_fb = breakable._fill(fb, bucket)
    s = mark("fill", s)
    breakable.replay_metadata(breakable.captured_metadata[bucket], fb, static_fb)
    s = mark("metadata", s)
    with forward_context(static_fb, breakable.attn_backend, n, breakable.model_runner.dp_moe(bucket)):
        breakable.graphs[bucket].replay()
    s = mark("replay", s)
    compute_logits(breakable.model, breakable.outputs[bucket], fb)
    mark("logits", s)
    torch.cuda.synchronize()
    return t


def break_host_times(breakable, fb, iters: int = 20) -> list:
    """Host µs per segment launch and per break (the break op's own enqueueing, attention
    kernel launch included), averaged over `iters` replays without syncs."""
    n = fb.num_tokens
    bucket = breakable.bucket_for(n)
    graph = breakable.graphs[bucket]
    seg_sum, brk_sum = None, None
    for _ in range(iters):
        static_fb = breakable._fill(fb, bucket)
        breakable.replay_metadata(breakable.captured_metadata[bucket], fb, static_fb)
        with forward_context(static_fb, breakable.attn_backend, n, breakable.model_runner.dp_moe(bucket)):
            segs, brks = [], []
            graph.replay(host_seconds=(segs, brks))
        seg_sum = segs if seg_sum is None else [a + b for a, b in zip(seg_sum, segs)]
        brk_sum = brks if brk_sum is None else [a + b for a, b in zip(brk_sum, brks)]
        torch.cuda.synchronize()
    seg = [1e6 * v / iters for v in seg_sum]
    brk = [1e6 * v / iters for v in brk_sum]
    out = [f"== {fb.forward_mode.name.lower()} {n}: host µs per segment launch and per break ({len(seg)} segments, "
           f"{len(brk)} breaks; mean of {iters} replays)",
           f"  segment launch: mean {sum(seg) / len(seg):8.1f}  max {max(seg):8.1f}  total {sum(seg):9.1f}",
           f"  break:          mean {sum(brk) / max(1, len(brk)):8.1f}  max {max(brk, default=0):8.1f}  "
           f"total {sum(brk):9.1f}",
           "  per segment: " + " ".join(f"{v:.0f}" for v in seg),
           "  per break:   " + " ".join(f"{v:.0f}" for v in brk)]
    return out


def metadata_host_profile(breakable, fb, iters: int = 50) -> list:
    """cProfile of the metadata refresh (host functions by own time), `iters` builds."""
    import cProfile
    import io
    import pstats
    n = fb.num_tokens
    bucket = breakable.bucket_for(n)
    static_fb = breakable._fill(fb, bucket)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        breakable.replay_metadata(breakable.captured_metadata[bucket], fb, static_fb)
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
    return [f"== {fb.forward_mode.name.lower()} {n}: metadata refresh, cProfile of {iters} builds (own time)", buf.getvalue()]


def host_syncs_of_one_replay(runner, fb) -> list:
    """Every synchronizing CUDA call of one replay step (torch's sync debug mode), with the
    Python line that made it: a sync serialises host and GPU, so the step costs host + GPU."""
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            runner.forward(fb)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    lines = sorted({f"{w.filename}:{w.lineno}: {str(w.message).splitlines()[0]}" for w in caught})
    return [f"== {fb.forward_mode.name.lower()} {fb.num_tokens}: synchronizing calls in one replay step: {len(caught)}"] + \
        [f"  {line}" for line in lines]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model-path", default="dsv4-mini")
    p.add_argument("--num-tokens", type=int, nargs="+", default=[64, 256])
    p.add_argument("--modes", nargs="+", default=["mixed"], choices=["extend", "mixed"],
                   help="extend: prefill chunks of one request each; mixed: a chunk plus decode rows")
    p.add_argument("--context-length", type=int, default=8192)
    p.add_argument("--segment-kernels", default="auto", choices=("auto", "on", "off"))
    p.add_argument("--out", default=".")
    a = p.parse_args()
    n_reqs = 2 * (max(a.num_tokens) // 1024 + 34)
    args = ServerArgs(
        model_path=a.model_path, device="cuda", dtype="bfloat16", context_length=a.context_length,
        max_running_requests=n_reqs, max_total_tokens=n_reqs * (1024 + 1024 + 128),
        enable_breakable_cuda_graph=True, breakable_cuda_graph_tokens=sorted(set(a.num_tokens)),
        breakable_cuda_graph_max_tokens=max(a.num_tokens), disable_cuda_graph=True, segment_kernels=a.segment_kernels,
    ).resolve(cuda_available=True)
    runner = ModelRunner(args)
    breakable = runner.breakable_runner
    report = []
    for mode, n in [(m, n) for m in a.modes for n in a.num_tokens]:
        fb, slots = make_batch(runner, mode, n, 1024, 1024, min(32, n // 2) if mode == "mixed" else 0)
        with torch.inference_mode():
            for _ in range(3):
                phases(breakable, fb, sync=False)
            iters = 20
            acc_async, acc_sync = {}, {}
            for _ in range(iters):
                for k, v in phases(breakable, fb, sync=False).items():
                    acc_async[k] = acc_async.get(k, 0.0) + v / iters
                for k, v in phases(breakable, fb, sync=True).items():
                    acc_sync[k] = acc_sync.get(k, 0.0) + v / iters
            report.append(f"== {mode} {n} tokens: host ms per phase (no sync) / (sync after each)")
            for k in acc_async:
                report.append(f"  {k:10s} {acc_async[k] * 1e3:8.3f} {acc_sync[k] * 1e3:8.3f}")
            report.append(f"  {'total':10s} {sum(acc_async.values()) * 1e3:8.3f} {sum(acc_sync.values()) * 1e3:8.3f}")

            report += break_host_times(breakable, fb)
            report += metadata_host_profile(breakable, fb)
            report += host_syncs_of_one_replay(runner, fb)

            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                breakable.forward_padded_eager(fb)
                torch.cuda.synchronize()
            report.append(f"== {mode} {n}: GPU kernels of one padded eager step")
            report.append(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30))
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                runner.forward(fb)
                torch.cuda.synchronize()
            report.append(f"== {mode} {n}: host ops of one replay")
            report.append(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                runner.forward(fb)
                torch.cuda.synchronize()
            report.append(f"== {mode} {n}: GPU kernels of one replay (segments and eager breaks)")
            report.append(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
        for s in slots:
            runner.req_to_token_pool.free_req(s)
        print("\n".join(report[-5:]), flush=True)
    text = "\n".join(report)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "profile_bcg_step.txt"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
