"""Times the fp32 GEMMs of one DeepSeek-V4-Flash layer against their bf16 tensor-core
replacements (layers/tensor_core_gemm.py) at Flash shapes, each op replayed from a CUDA graph:
wo_a (FP8 dequantized per step, grouped einsum; or the FP8 weight-only GEMM per group that
decode-sized steps take), the c4 / c128 compressors' and the c4 indexer's wkv + wgate, the
router's logits.

    python benchmark/layers/bench_tensor_core_gemm.py [--tokens 16 128 512 4096] [--iters 50] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from dsv4_kernels import quant_reference as Q

from sglang.srt.layers import tensor_core_gemm as tc
from sglang.srt.layers.attention.dsv4.compressor import SPLIT_TERMS
from sglang.srt.layers.quantization.fp8_linear import Fp8BlockLinear

HIDDEN, HEADS, HEAD_DIM, GROUPS, O_LORA, EXPERTS, INDEX_DIM = 4096, 64, 512, 8, 1024, 256, 128


def graph_ms(fn, iters: int) -> float:
    """Mean ms of `fn` replayed from a CUDA graph of `iters` calls (launch overhead excluded)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(iters):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def cases(T: int, dev: torch.device):
    x = torch.randn(T, HIDDEN, device=dev).to(torch.bfloat16)
    d = HEADS * HEAD_DIM // GROUPS
    q, s = Q.quantize_fp8_weight(torch.randn(GROUPS * O_LORA, d, device=dev) * 0.02)
    o = torch.randn(T, GROUPS, d, device=dev).to(torch.bfloat16)

    def wo_a_fp32():
        w = Q.dequantize_fp8_block(q, s).view(GROUPS, O_LORA, d)
        return torch.einsum("tgd,grd->tgr", o.float(), w).to(torch.bfloat16)

    def wo_a_bf16():
        return tc.grouped_bf16_einsum(o, Q.dequantize_fp8_block(q, s, torch.bfloat16).view(GROUPS, O_LORA, d))

    yield "wo_a (dequant + grouped einsum)", 2 * T * GROUPS * d * O_LORA, wo_a_fp32, wo_a_bf16
    lin = Fp8BlockLinear(d, GROUPS * O_LORA, act_quant=False).to(dev)
    lin.weight.data.copy_(q)
    lin.weight_scale.data.copy_(s)
    # the model takes this path at T <= WO_A_FP8_GEMM_MAX_TOKENS: compare it with the row above
    yield ("wo_a (FP8 grouped GEMM, no dequant)", 2 * T * GROUPS * d * O_LORA, wo_a_fp32,
           lambda: lin.grouped_forward(o))
    for name, n in (("c4 compressor wkv+wgate", 2 * HEAD_DIM), ("c4 indexer compressor wkv+wgate", 2 * INDEX_DIM),
                    ("c128 compressor wkv+wgate", HEAD_DIM)):
        wkv, wgate = (torch.randn(n, HIDDEN, device=dev) * 0.02 for _ in range(2))
        split = tc.split_weight([wkv, wgate], SPLIT_TERMS)

        def fp32(wkv=wkv, wgate=wgate):
            xf = x.float()
            return F.linear(xf, wkv), F.linear(xf, wgate)

        yield name, 2 * T * HIDDEN * 2 * n, fp32, lambda split=split: tc.split_linear(x, split)
    gate = (torch.randn(EXPERTS, HIDDEN, device=dev) * 0.02).to(torch.bfloat16)
    yield ("router logits", 2 * T * HIDDEN * EXPERTS, lambda: F.linear(x.float(), gate.float()),
           lambda: tc.mm_fp32(x, gate.t()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[16, 128, 512, 4096])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", default=None, help="also write the rows as JSON")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_tensor_core_gemm.py needs a CUDA GPU")
    rows = []
    print(f"{'op':36s} {'T':>5s} {'fp32 ms':>9s} {'bf16 tc ms':>10s} {'speed-up':>8s} {'fp32 TFLOP/s':>12s}")
    for T in args.tokens:
        for name, flops, old, new in cases(T, torch.device("cuda")):
            a, b = graph_ms(old, args.iters), graph_ms(new, args.iters)
            rows.append(dict(op=name, tokens=T, fp32_ms=a, tensor_core_ms=b, flops=flops))
            print(f"{name:36s} {T:5d} {a:9.3f} {b:10.3f} {a / b:7.1f}x {flops / a / 1e9:12.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
