"""Host µs per call of the pieces of a breakable-graph break, on a GPU.

A replayed step at 16 tokens is host-bound (docs/benchmarks.md §3): its breaks cost
130-365 µs of host time while the Python around them costs 6-25 µs. This splits the rest:
Triton's launch path against the raw launcher, by argument count, and each break's calls at
dsv4-mini's shapes (16 heads x 512, window 128, c4 top-256, 16 tokens).

The GPU work of every case is far below its host time, so the launch queue never pushes back
and the loop's wall time is host time.

    python benchmark/bcg/bench_launch_overhead.py [--iters 2000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import triton
import triton.language as tl


@triton.jit
def _two_args_kernel(x_ptr, n):
    tl.store(x_ptr + tl.program_id(0), n)


@triton.jit
def _forty_args_kernel(
    p0, p1, p2, p3, p4, p5, p6, p7, p8, p9, p10, p11, p12, p13, p14, p15, p16, p17, p18, p19,
    i0, i1, i2, i3, i4, i5, i6, i7, i8, i9, i10, i11, i12, i13, i14, i15, i16, i17, i18, i19,
    A: tl.constexpr, B: tl.constexpr, C: tl.constexpr, D: tl.constexpr,
):
    tl.store(p0 + tl.program_id(0), i0 + i19 + A + B + C + D)


def host_us(fn, iters: int, repeats: int) -> tuple[float, float]:
    """Median and spread (max - min) of the host µs per call over `repeats` timed loops."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        runs.append((time.perf_counter() - t0) / iters * 1e6)
        torch.cuda.synchronize()
    return statistics.median(runs), max(runs) - min(runs)


def raw_launcher(compiled, grid, args):
    """The launch without JITFunction.run (binding, specialization, cache key): what a cached
    launcher could at best reach."""
    from triton.runtime import driver

    compiled._init_handles()
    run, function, packed = compiled.run, compiled.function, compiled.packed_metadata
    g0, g1, g2 = (tuple(grid) + (1, 1))[:3]

    def launch():
        stream = driver.active.get_current_stream(driver.active.get_current_device())
        run(g0, g1, g2, stream, function, packed, None, None, None, *args)

    return launch


def launch_cases(dev):
    x = torch.zeros(1024, device=dev, dtype=torch.int32)
    ptrs = [torch.zeros(1024, device=dev, dtype=torch.int32) for _ in range(20)]
    ints = [17 + 32 * i for i in range(20)]
    consts = dict(A=1, B=2, C=3, D=4)
    k2 = _two_args_kernel[(1,)](x, 5)
    k40 = _forty_args_kernel[(1,)](*ptrs, *ints, **consts)
    return {
        "triton launch, 2 args": lambda: _two_args_kernel[(1,)](x, 5),
        "raw launcher, 2 args": raw_launcher(k2, (1,), (x, 5)),
        "triton launch, 40 args + 4 constexpr": lambda: _forty_args_kernel[(1,)](*ptrs, *ints, **consts),
        "raw launcher, 40 args + 4 constexpr": raw_launcher(k40, (1,), (*ptrs, *ints, *consts.values())),
        "torch.empty x3 (split partials)": lambda: (torch.empty(16, 4, 16, 512, device=dev),
                                                   torch.empty(16, 4, 16, device=dev),
                                                   torch.empty(16, 4, 16, device=dev)),
    }


def break_cases(dev):
    """dsv4-mini's break calls at 16 tokens over a 1024-token context."""
    from dsv4_kernels.indexer import indexer_topk
    from dsv4_kernels.sparse_attention import SparseAttnConfig, measured_config, sparse_attn_with_sink

    torch.manual_seed(0)
    T, H, D, W, C, topk = 16, 16, 512, 128, 1024, 256
    bf = torch.bfloat16
    q = torch.randn(T, H, D, device=dev, dtype=bf)
    kv = torch.randn(4096, D, device=dev, dtype=bf)
    win = torch.randint(0, 4096, (T, W), device=dev, dtype=torch.int32)
    win_len = torch.full((T,), W, device=dev, dtype=torch.int32)
    kv_b = torch.randn(1024, D, device=dev, dtype=bf)
    idx_b = torch.randint(0, 1024, (T, topk), device=dev, dtype=torch.int32)
    len_b = torch.full((T,), topk, device=dev, dtype=torch.int32)
    sink = torch.randn(H, device=dev, dtype=torch.float32)
    out = torch.empty_like(q)
    auto = measured_config(T)
    one = SparseAttnConfig(block_h=auto.block_h, keys_as_m=auto.keys_as_m, num_splits=1)
    # what pick_num_splits chose before its MIN_BLOCKS_PER_SPLIT cap (16 programs, 132 SMs)
    eight = SparseAttnConfig(block_h=auto.block_h, keys_as_m=auto.keys_as_m, num_splits=8)

    def attn(config, with_b):
        b = (kv_b, idx_b, len_b) if with_b else (None, None, None)
        return lambda: sparse_attn_with_sink(q, kv, win, win_len, *b, sink, 0.044, out=out, config=config)

    iq = torch.randn(T, 16, 128, device=dev, dtype=bf)
    iw = torch.randn(T, 16, device=dev, dtype=torch.float32)
    ikeys = torch.randn(C // 4, 128, device=dev, dtype=bf)
    cand = torch.arange(C // 4, device=dev, dtype=torch.int32).expand(T, C // 4).contiguous()
    cand_len = torch.full((T,), C // 4, device=dev, dtype=torch.int32)
    cases = {
        "c0 attention, 8 splits (attention + merge + 3 allocs)": attn(eight, False),
        "c0 attention, one split (one launch)": attn(one, False),
        "c0 attention, auto splits": attn(auto, False),
        "c4 attention (window + top-k list), 8 splits": attn(eight, True),
        "c4 attention, one split": attn(one, True),
        "c4 attention, auto splits": attn(auto, True),
    }
    slots = torch.empty(T, topk, device=dev, dtype=torch.int32)
    cases["c4 indexer top-k (logits keys + torch.topk + slots)"] = \
        lambda: indexer_topk(iq, iw, ikeys, cand, cand_len, topk, slots)
    cases["torch.topk [16, 256] int64"] = lambda k=torch.randint(0, 1 << 40, (T, C // 4), device=dev): \
        torch.topk(k, topk, dim=1)
    return cases



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_launch_overhead.py times CUDA launches: it needs a CUDA GPU")
    dev = torch.device("cuda")
    print(f"triton {triton.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print(f"{'case':62s} {'host µs':>8s} {'spread':>7s}")
    for group in (launch_cases, break_cases):
        for name, fn in group(dev).items():
            try:
                med, spread = host_us(fn, args.iters, args.repeats)
                print(f"{name:62s} {med:8.1f} {spread:7.1f}")
            except Exception as e:  # noqa: BLE001 - one failing case must not hide the others
                print(f"{name:62s} failed: {type(e).__name__}: {str(e)[:200]}")


if __name__ == "__main__":
    main()
