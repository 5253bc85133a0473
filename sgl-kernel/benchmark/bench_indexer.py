"""Indexer logits (64 heads x 128 dims, bf16 keys) and the full top-512 selection, replayed from
a CUDA graph. Bytes of the logits kernel = gathered keys + q + fp32 logits written."""

import torch

from common import report, require_cuda, time_ms

NH, DI, TOPK = 64, 128, 512


def main():
    if not require_cuda():
        return
    from dsv4_kernels import indexer, ops

    keys = torch.randn(1 << 18, DI, device="cuda", dtype=torch.bfloat16)
    print(f"== indexer (nH={NH}, Di={DI}, topk={TOPK})")
    for T, C in ((64, 4096), (64, 16384), (1024, 4096), (1024, 16384)):
        q = torch.randn(T, NH, DI, device="cuda", dtype=torch.bfloat16)
        w = torch.rand(T, NH, device="cuda")
        slots = torch.randint(0, keys.shape[0], (T, C), device="cuda", dtype=torch.int32)
        lens = torch.full((T,), C, device="cuda", dtype=torch.int32)
        logits = torch.empty(T, C, device="cuda")
        out = torch.empty(T, TOPK, device="cuda", dtype=torch.int32)
        nbytes = T * C * (DI * 2 + 4 + 4) + q.numel() * 2
        flops = 2 * T * NH * C * DI
        ms = time_ms(lambda: indexer.indexer_logits(q, w, keys, slots, lens, logits), graph=True)
        report(f"indexer_logits T={T} C={C}", ms, nbytes, flops)
        ms = time_ms(lambda: ops.indexer_topk(q, w, keys, slots, lens, TOPK, out), graph=True)
        report(f"indexer_topk (logits + torch.topk) T={T} C={C}", ms, nbytes, flops)


if __name__ == "__main__":
    main()
