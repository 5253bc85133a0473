"""The MoE's routing alignment at Flash's routed experts (256, top-6, uniform random routing),
replayed from a CUDA graph with a cold L2: `moe_align` (the sorted, block-padded assignment
list and each block's expert) and `align_and_quantize` (the same launch also rounding the
activations [T, 4096] to FP8, what humming's decode path runs), per token count and block
height. Up to ALIGN_ONE_KERNEL_MAX_M assignments these are one launch (moe.align_program);
beyond, the torch sort.

    python sgl-kernel/benchmark/bench_moe_align.py
"""

import torch

from common import require_cuda, time_ms

EXPERTS, TOPK, HIDDEN = 256, 6, 4096
# (tokens, block height): decode 1 / 4 / 16 / 64 at the heights humming's decode configs use,
# a 256-token batch and the one-kernel path's largest
SHAPES = ((1, 16), (4, 16), (16, 16), (64, 16), (64, 32), (256, 64), (682, 64))


def main():
    if not require_cuda():
        return
    from dsv4_kernels import moe
    from dsv4_kernels.moe_act import align_and_quantize

    gen = torch.Generator(device="cuda").manual_seed(0)
    print(f"{'T':>5} {'assignments':>11} {'block':>5} {'moe_align us':>13} {'align_and_quantize us':>22}")
    for T, block in SHAPES:
        _, ids = torch.randn(T, EXPERTS, device="cuda", generator=gen).topk(TOPK, dim=1)
        ids = ids.int()
        x = torch.randn(T, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
        align = time_ms(lambda: moe.moe_align(ids, EXPERTS, block, return_used=True), graph=True)
        fused = time_ms(lambda: align_and_quantize(ids, EXPERTS, block, x), graph=True)
        print(f"{T:5d} {ids.numel():11d} {block:5d} {align * 1e3:13.2f} {fused * 1e3:22.2f}", flush=True)


if __name__ == "__main__":
    main()
