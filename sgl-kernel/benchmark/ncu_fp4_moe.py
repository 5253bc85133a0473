"""One FP4 MoE call at Flash's expert dims, shaped for Nsight Compute: where the gemv variant
loses its HBM bandwidth (17% of it at T = 64 on an H200, docs/benchmarks.md §4).

bench_quant.py says how fast each variant is; this says why. It builds one routed-expert
shard (hidden 4096, inter 2048, top-6 of 256, uniformly random ids, release numerics), runs the
chosen variant once to compile, synchronizes, then runs it `--calls` more times. Under ncu
skip the warm-up's launches and profile the next ones:

    ncu --clock-control none --kernel-name regex:_gemv_gate_up --launch-skip 1 --launch-count 1 \\
        --section SpeedOfLight --section Occupancy --section WarpStateStats \\
        --section MemoryWorkloadAnalysis python sgl-kernel/benchmark/ncu_fp4_moe.py --variant gemv --t 64

Without ncu it prints the median time of `--calls` CUDA-event-timed calls and the bandwidth of
the weight bytes the call touches, so the profiled call can be checked against bench_quant's.
(KINDS.md: ncu reads the counters on the Firecracker machines only; try it first.)
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_quant import MOE_D, MOE_E, MOE_EXPERT_BYTES, MOE_TOPK, fp4_expert_weights  # noqa: E402
from common import hbm_gbps, require_cuda  # noqa: E402


def build(local_experts: int, T: int, seed: int = 0):
    """One shard's experts, and T tokens routed top-6 of 256 uniformly (ids past the shard are
    skipped, as a shard sees them)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    ws = fp4_expert_weights(local_experts, generator=g)
    x = torch.randn(T, MOE_D, device="cuda", generator=g).bfloat16()
    ids = torch.rand(T, MOE_E, device="cuda", generator=g).argsort(dim=1)[:, :MOE_TOPK].int()
    weights = torch.rand(T, MOE_TOPK, device="cuda", generator=g)
    return ws, x, ids, weights


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", choices=("gemv", "bf16"), default="gemv")
    ap.add_argument("--t", type=int, default=64, help="tokens")
    ap.add_argument("--experts", type=int, default=MOE_E, help="local experts (128: one EP-2 shard)")
    ap.add_argument("--calls", type=int, default=5, help="calls after the warm-up one")
    args = ap.parse_args(argv)
    if not require_cuda():
        return 0
    from dsv4_kernels import fp4_moe

    ws, x, ids, weights = build(args.experts, args.t)
    out = torch.empty(args.t, MOE_D, device="cuda")

    def call():
        fp4_moe.fp4_fused_moe(x, *ws, ids, weights, 10.0, out, True, args.variant)

    call()  # compiles; ncu's --launch-skip passes over its kernels
    torch.cuda.synchronize()
    times = []
    for _ in range(args.calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    hit = int(ids[ids < args.experts].unique().numel())
    ms = statistics.median(times)
    gbps = hit * MOE_EXPERT_BYTES / ms / 1e6
    print(f"{args.variant} T={args.t} experts={args.experts}: {ms:.3f} ms median of {args.calls} "
          f"(spread {max(times) - min(times):.3f} ms), {hit} experts hit, "
          f"{gbps:.0f} GB/s of weights ({100 * gbps / hbm_gbps():.1f}% of HBM)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
