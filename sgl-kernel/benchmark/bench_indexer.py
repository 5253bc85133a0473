"""Indexer logits (64 heads x 128 dims, bf16 keys) and the full top-512 selection, replayed from
a CUDA graph, with the candidates as a materialized [T, C] list and read through the page
table (PageTableList, the runtime's form: one more gathered int32 per candidate, and no list).
Bytes of the logits kernel = gathered keys + q + fp32 logits written (+ the list or the
page-table entries read)."""

import torch

from common import report, require_cuda, time_ms

NH, DI, TOPK = 64, 128, 512


def main():
    if not require_cuda():
        return
    from dsv4_kernels import PageTableList, indexer, ops

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
        # the same shapes through a page table: 8 requests of 4C positions in shuffled 128-token pages
        pages = torch.randperm(keys.shape[0] * 4 // 128, device="cuda")[: 8 * 4 * C // 128].view(8, -1)
        pos = torch.arange(4 * C, device="cuda")
        rtt = (pages[:, pos // 128] * 128 + pos % 128).int()
        cands = PageTableList(rtt, torch.randint(0, 8, (T,), device="cuda", dtype=torch.int32), 4, C)
        ms = time_ms(lambda: indexer.indexer_logits(q, w, keys, cands, lens, logits), graph=True)
        report(f"indexer_logits page table T={T} C={C}", ms, nbytes, flops)
        ms = time_ms(lambda: ops.indexer_topk(q, w, keys, cands, lens, TOPK, out), graph=True)
        report(f"indexer_topk page table T={T} C={C}", ms, nbytes, flops)


if __name__ == "__main__":
    main()
