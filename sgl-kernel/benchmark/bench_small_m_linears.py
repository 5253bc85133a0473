"""Decode-size linears: cuBLAS vs the Triton GEMM vs the GEMVs, side by side.

    python sgl-kernel/benchmark/bench_small_m_linears.py [--m 1 2 4 8 16] [--sweep 1 4] [--json out.json]

Flash's FP8 linears (wq_a, wq_b, wkv, the indexer's wq_b, wo_b, the shared expert's gate/up and
down) and wo_a's grouped weight-only product, each timed alone as one CUDA-graph replay after an
L2 flush (median and p10-p90 of REPS), against reading its weight once at HBM speed. Release
numerics (FP8 activations) everywhere but wo_a; every output is checked against cuBLAS's (or the
grouped Triton kernel's) before it is timed. `--sweep 1 4` times every GEMV tile at each shape at
those M (what fp8_gemv.gemv_config's choices come from).

Then the bf16 linears with fp32 sums at one row (bf16_gemv.py): the router's logits, the
indexer's head weights and the compressors' split-bf16 wkv + wgate, as the model runs them on
cuBLAS (an fp32-output GEMM; for a split weight after concatenating x three times; for the head
weights a bf16 GEMM, a cast and a scale) and as one GEMV launch.
"""

import argparse
import itertools
import json

import torch

from bench_quant import _time
from common import hbm_gbps, require_cuda

FLASH = [  # (name, N, K): Flash's FP8 block-scaled linears
    ("wq_a", 1024, 4096), ("wq_b", 32768, 1024), ("wkv", 512, 4096), ("idx_wq_b", 8192, 1024),
    ("wo_b", 4096, 8192), ("shared_gate_up", 2048, 4096), ("shared_down", 4096, 2048),
    # the linears that read one input, as one stacked weight (Fp8RowStack): one launch each
    ("wq_a+wkv", 1536, 4096), ("wq_b+idx_wq_b", 40960, 1024),
]
WO_A = (8, 1024, 4096)  # groups, rows per group, K
BF16_FP32 = [  # (name, N, terms, K): bf16 x bf16 -> fp32 linears of one row (bf16_gemv.py)
    ("router_logits", 256, 1, 4096), ("idx_weights", 64, 1, 4096), ("c4_compressor", 2048, 3, 4096),
    ("c128_compressor", 1024, 3, 4096), ("idx_compressor", 512, 3, 4096),
]
REPS = 30


def time_graph(fn):
    """(median, p10, p90) µs of CUDA-graph replays of fn, L2 flushed before each."""
    return tuple(ms * 1e3 for ms in _time(fn, REPS))


def weights(N, K, gen):
    w = (torch.randn(N, K, device="cuda", generator=gen) * 0.5).to(torch.float8_e4m3fn)
    ws = 2.0 ** torch.randint(-9, -4, (N // 128, K // 128), device="cuda", generator=gen).float()
    return w, ws


def close(a, b) -> bool:
    err = (a.float() - b.float()).abs().max().item()
    return err <= 2e-2 * b.float().abs().max().item() + 1e-3


def sweep_configs():
    for bn, bk, warps, stages in itertools.product((1, 2, 4, 8, 16), (512, 1024, 2048, 4096), (4, 8), (2, 3)):
        if bn * bk <= 16384:  # larger tiles spill
            yield dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--sweep", type=int, nargs="*", default=[], metavar="M",
                   help="every GEMV tile at these M (<= 4)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if not require_cuda():
        return 0
    from dsv4_kernels import fp8_gemm, fp8_gemv

    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []

    def record(name, M, impl, timing, nbytes, **extra):
        us, p10, p90 = timing
        pct = 100 * nbytes / (us * 1e-6) / (hbm_gbps() * 1e9)
        rows.append(dict(name=name, M=M, impl=impl, us=us, p10=p10, p90=p90, bytes=nbytes, pct_hbm=pct, **extra))
        print(f"{name:<15} M={M:<3} {impl:<40} {us:8.2f} us [{p10:7.2f}-{p90:7.2f}]  {pct:5.1f}% of HBM "
              f"(bound {nbytes / hbm_gbps() / 1e3:6.2f} us)", flush=True)

    for name, N, K in FLASH:
        w, ws = weights(N, K, gen)
        nbytes = N * K + ws.numel() * 4
        for M in a.m:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
            ref = fp8_gemm.fp8_block_linear(x, w, ws, True, backend="cublas")
            record(name, M, "cublas", time_graph(lambda: fp8_gemm.fp8_block_linear(x, w, ws, True, backend="cublas")),
                   nbytes)
            got = fp8_gemm.fp8_block_linear(x, w, ws, True, backend="triton")
            assert close(got, ref), f"triton {name} M={M}"
            record(name, M, "triton", time_graph(lambda: fp8_gemm.fp8_block_linear(x, w, ws, True, backend="triton")),
                   nbytes)
            if M > fp8_gemv.MAX_ROWS:
                continue
            cfgs = [None] + ([c for c in sweep_configs() if c["BLOCK_K"] <= max(K, 1024)] if M in a.sweep else [])
            for cfg in cfgs:
                got = fp8_gemv.fp8_gemv(x, w, ws, True, cfg)
                assert close(got, ref), f"gemv {name} M={M} {cfg}"
                label = "gemv " + ("default " + json.dumps(fp8_gemv.gemv_config(M, N, K)) if cfg is None
                                   else json.dumps(cfg))
                record(name, M, label, time_graph(lambda: fp8_gemv.fp8_gemv(x, w, ws, True, cfg)), nbytes,
                       config=cfg or fp8_gemv.gemv_config(M, N, K))

    G, n, K = WO_A
    w, ws = weights(G * n, K, gen)
    nbytes = G * n * K + ws.numel() * 4
    for M in a.m:
        x = torch.randn(M, G, K, device="cuda", dtype=torch.bfloat16, generator=gen)
        tiles = fp8_gemm.gemm_config(M, G * n, K, False)  # a config forces the tensor-core kernel
        ref = fp8_gemm.fp8_grouped_linear(x, w, ws, tiles)
        record("wo_a", M, "triton grouped",
               time_graph(lambda: fp8_gemm.fp8_grouped_linear(x, w, ws, tiles)), nbytes)
        if M > fp8_gemv.MAX_ROWS:
            continue
        for cfg in [None] + ([c for c in sweep_configs() if c["BLOCK_K"] <= max(K, 1024)] if M in a.sweep else []):
            got = fp8_gemv.fp8_grouped_gemv(x, w, ws, cfg)
            assert close(got, ref), f"grouped gemv M={M} {cfg}"
            label = "gemv " + ("default " + json.dumps(fp8_gemv.gemv_config(M, n, K, G)) if cfg is None
                               else json.dumps(cfg))
            record("wo_a", M, label, time_graph(lambda: fp8_gemv.fp8_grouped_gemv(x, w, ws, cfg)), nbytes,
                   config=cfg or fp8_gemv.gemv_config(M, n, K, G))

    from dsv4_kernels import bf16_gemv

    for name, N, terms, K in BF16_FP32:
        w = (torch.randn(N, terms * K, device="cuda", generator=gen) * 0.05).to(torch.bfloat16)
        x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16, generator=gen)
        nbytes = w.numel() * 2
        if name == "idx_weights":  # nn.Linear in bf16, then .float() * scale
            def cublas():
                return torch.nn.functional.linear(x, w).float() * 0.0625
        else:
            def cublas():
                xr = torch.cat([x] * terms, dim=-1) if terms > 1 else x
                return torch.mm(xr, w.t(), out_dtype=torch.float32)
        ref = cublas()
        record(name, 1, "cublas", time_graph(cublas), nbytes)
        rounded = name == "idx_weights"
        got = bf16_gemv.bf16_gemv(x, w, 0.0625 if rounded else 1.0, rounded)
        assert close(got, ref), f"bf16 gemv {name}"
        record(name, 1, "gemv " + json.dumps(bf16_gemv.gemv_config(N, K)),
               time_graph(lambda: bf16_gemv.bf16_gemv(x, w, 0.0625 if rounded else 1.0, rounded)), nbytes)

    print("\nbest per shape and M:")
    for (name, M), group in itertools.groupby(sorted(rows, key=lambda r: (r["name"], r["M"])),
                                              key=lambda r: (r["name"], r["M"])):
        group = list(group)
        best = min(group, key=lambda r: r["us"])
        base = next((r["us"] for r in group if r["impl"] in ("cublas", "triton grouped")), None)
        print(f"  {name:<15} M={M:<3} {best['impl'][:60]:<60} {best['us']:7.2f} us {best['pct_hbm']:5.1f}% HBM"
              + (f"  {base / best['us']:.2f}x the baseline" if base else ""))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
