"""Timing and roofline reporting shared by the kernel microbenchmarks (CUDA only)."""

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))  # sglang's planning tables

H200_COPY_GBPS = 4300.0  # achievable HBM3e copy bandwidth
H200_BF16_TFLOPS = 790.0  # dense bf16 matmul

_L2_FLUSH = None
_HBM_GBPS = None


def hbm_gbps() -> float:
    """The HBM peak (GB/s) of the GPU these run on, from its datasheet (planning.step_cost's
    table); an H200's, with a note, for a GPU not in it."""
    global _HBM_GBPS
    if _HBM_GBPS is None:
        from sglang.srt.planning.step_cost import H200, ceilings_for

        name = torch.cuda.get_device_name() if torch.cuda.is_available() else None
        ceilings = ceilings_for(name)
        if ceilings is None:
            print(f"HBM peak of {name or 'this machine'} unknown: the % of HBM below uses an H200's", flush=True)
            ceilings = H200
        _HBM_GBPS = ceilings.hbm_bytes_per_s / 1e9
    return _HBM_GBPS


def _flush_l2():
    # Small problems would otherwise be served from the 50 MB L2 between iterations.
    global _L2_FLUSH
    if _L2_FLUSH is None:
        _L2_FLUSH = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    _L2_FLUSH.zero_()


def time_ms(fn, warmup: int = 3, iters: int = 30, graph: bool = False) -> float:
    """Median time of fn in ms with a cold L2. graph=True replays fn from a CUDA graph, which
    is how everything but the attention break op runs in the model."""
    for _ in range(warmup):
        fn()
    run = fn
    if graph:
        g = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(g):
            fn()
        run = g.replay
    times = []
    for _ in range(iters):
        _flush_l2()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def report(name: str, ms: float, nbytes: float = 0.0, flops: float = 0.0) -> str:
    parts = [f"{name:<58} {ms * 1e3:9.1f} us"]
    if nbytes:
        gbps = nbytes / ms / 1e6
        parts.append(f"{gbps:8.0f} GB/s ({100 * gbps / H200_COPY_GBPS:5.1f}% of {H200_COPY_GBPS:.0f})")
    if flops:
        tflops = flops / ms / 1e9
        parts.append(f"{tflops:7.1f} TFLOP/s ({100 * tflops / H200_BF16_TFLOPS:5.1f}% of {H200_BF16_TFLOPS:.0f})")
    line = "  ".join(parts)
    print(line, flush=True)
    return line


def require_cuda() -> bool:
    if not torch.cuda.is_available():
        print("skipped: needs a CUDA GPU", flush=True)
        return False
    return True
