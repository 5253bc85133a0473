"""The FP4 routed experts side by side, per MoE backend, at DSV4-Flash's expert dims (hidden
4096, inter 2048, top-6, uniformly random routing), each step (routing alignment, activation
rounding, both expert GEMMs, SwiGLU, top-k sum) replayed from a CUDA graph with a cold L2:

- triton: sgl-kernel's FP4 MoE under release numerics (the model's `--moe-backend triton`);
- humming_w4a16: humming's indexed GEMMs on bf16 activations (weight-only numerics);
- humming_w4a8: humming's indexed GEMMs on e4m3 activations with our per-128 power-of-two
  scales (release numerics: the model's `--moe-backend humming`);
- grouped_mm_bf16: torch._grouped_mm on the experts dequantized to bf16 beforehand (what a user
  with 4x the weight memory would run), with its sort / gather / weighted scatter.

Columns per T: each backend's median time (10th-90th percentile of REPS replays), and the
limits: the HBM bound (the bytes of the distinct local experts hit, FP4 + scales, at the GPU's
HBM peak, common.hbm_gbps) and the FLOP bounds (the local assignments' three GEMMs at the bf16
and FP8 dense peaks). "% of limit" divides max(HBM bound, the FLOP bound of that backend's
tensor-core dtype) by the time.
Before timing, every backend's output is compared with the triton backend's at T = 64 (cosine).

    python sgl-kernel/benchmark/bench_moe_backends.py [--experts 256] [--t 1 4 16 64 ...] [--out moe.json]
    python sgl-kernel/benchmark/bench_moe_backends.py --experts 128   # one EP-2 rank's shard

Needs a CUDA GPU; the humming columns need humming-kernels (skipped with the reason otherwise).
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))
from bench_quant import _time as timed  # noqa: E402  (median, p10, p90) ms of graph replays, cold L2
from common import hbm_gbps, require_cuda  # noqa: E402

D, I, TOPK, LIMIT = 4096, 2048, 6, 10.0
BF16_PEAK_TFLOPS = 989.0
FP8_PEAK_TFLOPS = 1979.0
REPS = 20  # bench_quant._time's default
T_LIST = [1, 4, 16, 64, 256, 1024, 2048, 4096, 8192, 16384]
EXPERT_BYTES = 3 * (I * D // 2 + I * D // 32)  # FP4 codes + e8m0 scales of w1, w3, w2


def kernel_breakdown(fn, reps: int = 10) -> str:
    """GPU time per kernel name of one call (eager, after a warm-up), largest first."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    rows = [(e.device_time_total / reps, e.count // reps, e.key) for e in prof.key_averages() if e.device_time_total > 0]
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    return "\n".join([f"    {us:8.1f} us  x{n:<3d} {name[:110]}" for us, n, name in rows[:12]]
                     + [f"    {total:8.1f} us  kernel total"])


def make_experts(n_total: int, n_local: int, act_quant: bool, backend: str, packed):
    from sglang.srt.layers.moe.backends import make_fp4_backend
    from sglang.srt.layers.moe.experts import Fp4RoutedExperts

    with torch.device("cuda"):
        e = Fp4RoutedExperts(n_total, D, I, LIMIT, act_quant, (0, n_local), torch.bfloat16)
    for name, t in zip(("w1", "w1_scale", "w3", "w3_scale", "w2", "w2_scale"), packed):
        getattr(e, name).copy_(t.view(getattr(e, name).dtype))
    e.may_repeat_ids = False
    e.use_backend(make_fp4_backend(backend))
    return e


class GroupedMM:
    """bf16 experts (dequantized once) through torch._grouped_mm: sort by expert, gather, gate/up,
    SwiGLU x weight, down, weighted scatter-add. Static shapes: capturable."""

    def __init__(self, packed, n_local):
        from dsv4_kernels.quant_reference import dequantize_fp4

        w1, s1, w3, s3, w2, s2 = packed
        self.n_local = n_local

        def deq(w, s):
            return torch.stack([dequantize_fp4(w[e], s[e]).to(torch.bfloat16) for e in range(n_local)])

        self.w13 = torch.cat([deq(w1, s1), deq(w3, s3)], dim=1).transpose(1, 2)  # [E, D, 2I] (column-major B)
        self.w2 = deq(w2, s2).transpose(1, 2)  # [E, I, D]

    def __call__(self, x, weights, ids):
        flat = ids.reshape(-1).long()
        local = torch.where(flat < self.n_local, flat, self.n_local)
        order = torch.argsort(local, stable=True)
        counts = torch.zeros(self.n_local + 1, dtype=torch.long, device=x.device)
        counts = counts.scatter_add_(0, local, torch.ones_like(local))[: self.n_local]  # bincount syncs
        offs = torch.cumsum(counts, 0).to(torch.int32)
        rows = x[order // TOPK]
        gu = torch._grouped_mm(rows, self.w13, offs=offs)
        g, u = gu[:, :I].float(), gu[:, I:].float()
        h = (F.silu(g.clamp(max=LIMIT)) * u.clamp(-LIMIT, LIMIT) * weights.reshape(-1)[order, None]).bfloat16()
        down = torch._grouped_mm(h, self.w2, offs=offs).float()
        out = torch.zeros(x.shape[0], D, dtype=torch.float32, device=x.device)
        keep = (local[order] < self.n_local).float()[:, None]
        out.index_add_(0, order // TOPK, down * keep)
        return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, default=256, help="experts this GPU holds (256: all; 128: an EP-2 shard)")
    ap.add_argument("--t", type=int, nargs="+", default=T_LIST)
    ap.add_argument("--no-grouped-mm", action="store_true", help="skip the bf16 grouped_mm column (12 GB of bf16 experts)")
    ap.add_argument("--profile", type=int, nargs="*", default=[], help="print each backend's kernels at these T")
    ap.add_argument("--out", help="write the rows as JSON here")
    a = ap.parse_args()
    if not require_cuda():
        return
    from bench_quant import fp4_expert_weights
    from dsv4_kernels import ops

    from sglang.srt.layers.moe.backends import humming_unsupported

    n_total, n_local = 256, a.experts
    packed = fp4_expert_weights(n_local, torch.Generator(device="cuda").manual_seed(0))
    backends = {"triton": make_experts(n_total, n_local, True, "triton", packed)}
    reason = humming_unsupported("cuda", torch.bfloat16)
    if reason is None:
        backends["humming_w4a16"] = make_experts(n_total, n_local, False, "humming", packed)
        backends["humming_w4a8"] = make_experts(n_total, n_local, True, "humming", packed)
    else:
        print(f"humming columns skipped: {reason}", flush=True)
    grouped = None if a.no_grouped_mm else GroupedMM(packed, n_local)
    del packed
    torch.cuda.empty_cache()
    gen = torch.Generator(device="cuda").manual_seed(1)
    name = torch.cuda.get_device_name()
    print(f"== FP4 MoE backends on {name}: d={D} I={I} top-{TOPK}, {n_local} of {n_total} experts local, "
          f"graph replays, cold L2, median (p10-p90) of {REPS}", flush=True)
    rows = []
    for T in a.t:
        x = torch.randn(T, D, device="cuda", generator=gen).bfloat16()
        weights, ids = ops.moe_route(torch.randn(T, n_total, device="cuda", generator=gen), None, TOPK, 2.5)
        local_ids = ids  # experts [0, n_local): ids >= n_local are other ranks' (skipped)
        hit = int(torch.unique(ids[ids < n_local]).numel())
        assigns = int((ids < n_local).sum())
        hbm_ms = hit * EXPERT_BYTES / hbm_gbps() / 1e6
        flops = 2 * assigns * 3 * D * I
        bf16_ms, fp8_ms = flops / BF16_PEAK_TFLOPS / 1e9, flops / FP8_PEAK_TFLOPS / 1e9
        row = {"T": T, "experts_hit": hit, "hbm_bound_ms": hbm_ms, "bf16_flop_bound_ms": bf16_ms,
               "fp8_flop_bound_ms": fp8_ms}
        ref = None
        for bname, e in backends.items():
            out = e(x, weights, local_ids)
            if bname == "triton":
                ref = out
            cos = F.cosine_similarity(out.flatten().float(), ref.flatten().float(), dim=0).item()
            ms, p10, p90 = timed(lambda e=e: e(x, weights, local_ids))
            limit = max(hbm_ms, bf16_ms if bname.endswith("w4a16") else fp8_ms)
            row[bname] = {"ms": ms, "p10": p10, "p90": p90, "pct_of_limit": 100 * limit / ms, "cos_vs_triton": cos}
        if grouped is not None:
            bf16_hbm_ms = hit * 3 * I * D * 2 / hbm_gbps() / 1e6
            try:
                out = grouped(x, weights, ids)
                cos = F.cosine_similarity(out.flatten(), ref.flatten().float(), dim=0).item()
                ms, p10, p90 = timed(lambda: grouped(x, weights, ids))
                row["grouped_mm_bf16"] = {"ms": ms, "p10": p10, "p90": p90,
                                          "pct_of_limit": 100 * max(bf16_hbm_ms, bf16_ms) / ms, "cos_vs_triton": cos}
            except RuntimeError as e:  # torch._grouped_mm is private: say so rather than lose the table
                print(f"  grouped_mm_bf16 at T={T}: {type(e).__name__}: {str(e)[:120]}", flush=True)
        if T in a.profile:
            for bname, e in backends.items():
                print(f"  kernels of {bname} at T={T}:\n" + kernel_breakdown(lambda e=e: e(x, weights, local_ids)),
                      flush=True)
        rows.append(row)
        cols = "  ".join(f"{k} {v['ms'] * 1e3:8.1f} us ({v['p10'] * 1e3:.0f}-{v['p90'] * 1e3:.0f}) "
                         f"{v['pct_of_limit']:5.1f}% cos {v['cos_vs_triton']:.5f}"
                         for k, v in row.items() if isinstance(v, dict))
        print(f"T={T:<6} hit {hit:3d}  HBM bound {hbm_ms * 1e3:7.1f} us  FLOP bound bf16 {bf16_ms * 1e3:7.1f} / "
              f"fp8 {fp8_ms * 1e3:7.1f} us  |  {cols}", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps({"device": name, "experts_local": n_local, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
