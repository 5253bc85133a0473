"""Can the stock torch/cuBLAS GEMMs replace our Triton ones at prefill sizes? Times, on a GPU:
- torch._scaled_mm with DeepSeek block scales (activations 1 x 128, weights 128 x 128; cuBLAS
  on sm90 with CUDA >= 12.9) against dsv4_kernels' Triton fp8_block_linear and bf16 torch.mm,
  with the error against the dequantized fp32 product;
- torch._grouped_mm in bf16 at the routed-expert shapes of one EP rank (128 experts), the GEMM
  a decode-to-bf16 FP4 MoE would run.

    python sgl-kernel/benchmark/probe_torch_gemm.py
"""

from __future__ import annotations

import torch

from dsv4_kernels.fp8_act_quant import quantize_act
from dsv4_kernels.fp8_gemm import fp8_block_linear


def timed(fn, iters=20):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    times.sort()
    return times[len(times) // 2], times[0], times[-1]


def block_scaled_mm(a, a_s, w, w_s):
    """a e4m3 [M, K] + scales [M, K/128] (strides (1, M)); w e4m3 [N, K] + scales [N/128, K/128]."""
    return torch._scaled_mm(a, w.t(), scale_a=a_s, scale_b=w_s.t(), out_dtype=torch.bfloat16)


def probe_scaled_mm():
    print(f"torch {torch.__version__} cuda {torch.version.cuda}")
    for M, N, K, name in ((4096, 32768, 1024, "wq_b"), (4096, 4096, 8192, "wo_b"),
                          (4096, 1024, 4096, "wq_a"), (16384, 4096, 8192, "wo_b"),
                          (64, 32768, 1024, "wq_b")):
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = (torch.randn(N, K, device="cuda") * 0.5).to(torch.float8_e4m3fn)
        w_s = torch.rand(N // 128, K // 128, device="cuda") * 0.01 + 0.001
        a, a_s = quantize_act(x)
        ref = (a.float() * a_s.repeat_interleave(128, 1)) @ (
            w.float() * w_s.repeat_interleave(128, 0).repeat_interleave(128, 1)).t()
        flop = 2 * M * N * K
        line = f"{name} M={M} N={N} K={K}:"
        try:
            y = block_scaled_mm(a, a_s, w, w_s)
            err = ((y.float() - ref).norm() / ref.norm()).item()
            med, lo, hi = timed(lambda: block_scaled_mm(a, a_s, w, w_s))
            line += f" cublas_block {med:.1f} us ({flop / med / 1e6:.0f} TFLOP/s, {lo:.0f}-{hi:.0f}) rel_err {err:.2e};"
        except Exception as e:  # noqa: BLE001 - a probe: report why the path is unavailable
            line += f" cublas_block unavailable ({type(e).__name__}: {str(e)[:160]});"
        y2 = fp8_block_linear(x, w, w_s, True, backend="triton")
        err2 = ((y2.float() - ref).norm() / ref.norm()).item()
        med, lo, hi = timed(lambda: fp8_block_linear(x, w, w_s, True, backend="triton"))
        line += f" triton {med:.1f} us ({flop / med / 1e6:.0f} TFLOP/s) rel_err {err2:.2e};"
        wb = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        med, lo, hi = timed(lambda: x @ wb.t())
        line += f" bf16_mm {med:.1f} us ({flop / med / 1e6:.0f} TFLOP/s)"
        print(line, flush=True)


def probe_grouped_mm():
    E, d, inter = 128, 4096, 2048
    for rows in (2048 * 6 // 2, 4096 * 6 // 2, 8192 * 6 // 2):
        counts = torch.distributions.Multinomial(rows, torch.ones(E)).sample().int().cuda()
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        a = torch.randn(rows, d, device="cuda", dtype=torch.bfloat16)
        w13 = torch.randn(E, d, 2 * inter, device="cuda", dtype=torch.bfloat16)  # [E, K, N]
        w2 = torch.randn(E, inter, d, device="cuda", dtype=torch.bfloat16)
        h = torch.randn(rows, inter, device="cuda", dtype=torch.bfloat16)
        flop_up, flop_down = 2 * rows * d * 2 * inter, 2 * rows * inter * d
        try:
            up = timed(lambda: torch._grouped_mm(a, w13, offs=offs))
            down = timed(lambda: torch._grouped_mm(h, w2, offs=offs))
            w13t = w13.transpose(1, 2).contiguous().transpose(1, 2)  # [E, K, N] with K contiguous
            up_t = timed(lambda: torch._grouped_mm(a, w13t, offs=offs))
            print(f"grouped_mm rows={rows}: gate_up {up[0]:.0f} us ({flop_up / up[0] / 1e6:.0f} TFLOP/s), "
                  f"K-major weights {up_t[0]:.0f} us; down {down[0]:.0f} us ({flop_down / down[0] / 1e6:.0f} TFLOP/s)",
                  flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"grouped_mm unavailable ({type(e).__name__}: {str(e)[:200]})")
        del w13, w2
    # What a decode-to-bf16 pass costs: bytes moved per expert group, as a plain copy.
    src = torch.empty(16 * 3 * d * inter // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty(16 * 3 * d * inter, dtype=torch.bfloat16, device="cuda")
    med, _, _ = timed(lambda: dst.copy_(src.repeat_interleave(4).view(torch.bfloat16)[: dst.numel()]))
    print(f"16 experts: a 4x byte-expanding copy {src.numel() / 2**20:.0f} MiB -> {dst.numel() * 2 / 2**20:.0f} MiB "
          f"takes {med:.0f} us (an upper bound for a decode kernel's traffic)")


if __name__ == "__main__":
    probe_scaled_mm()
    probe_grouped_mm()
