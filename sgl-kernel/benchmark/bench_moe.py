"""Grouped-GEMM MoE at DSV4-Flash expert shapes (d=4096, I=2048, 256 experts, top-6, bf16),
replayed from a CUDA graph (routing + align + two GEMMs + top-k sum). Bytes = weights of the
experts actually hit (what bounds decode); FLOP/s counts the three expert GEMMs."""

import torch

from common import report, require_cuda, time_ms

D, I, E, TOPK = 4096, 2048, 256, 6


def main():
    if not require_cuda():
        return
    from dsv4_kernels import ops, reference

    w1 = torch.empty(E, I, D, device="cuda", dtype=torch.bfloat16).normal_(0, 0.02)
    w3 = torch.empty_like(w1).normal_(0, 0.02)
    w2 = torch.empty(E, D, I, device="cuda", dtype=torch.bfloat16).normal_(0, 0.02)
    print(f"== fused_moe d={D} I={I} E={E} top-{TOPK}")
    for T in (1, 64, 512, 4096):
        x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
        weights, ids = ops.moe_route(torch.randn(T, E, device="cuda"), None, TOPK, 2.5)
        out = torch.empty_like(x)
        if T == 64:  # the reference runs all 256 experts densely: ~10 s, once
            expected = reference.fused_moe(x, w1, w3, w2, ids, weights, 10.0, torch.empty(T, D, device="cuda"))
            ops.fused_moe(x, w1, w3, w2, ids, weights, 10.0, out)
            err = ((out.float() - expected).abs().max() / expected.abs().max()).item()
            assert err < 3e-2, f"mismatch {err}"
        hit = ids.unique().numel()
        ms = time_ms(lambda: ops.fused_moe(x, w1, w3, w2, ids, weights, 10.0, out), graph=True)
        report(f"fused_moe T={T} experts_hit={hit}", ms, nbytes=hit * 3 * D * I * 2,
               flops=2 * T * TOPK * 3 * D * I)


if __name__ == "__main__":
    main()
