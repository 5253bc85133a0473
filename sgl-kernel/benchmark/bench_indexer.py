"""Indexer logits (64 heads x 128 dims, bf16 keys) and the full top-512 selection, replayed from
a CUDA graph, with the candidates as a materialized [T, C] list and read through the page
table (PageTableList, the runtime's form: one more gathered int32 per candidate, and no list).
Bytes of the logits kernel = gathered keys + q + the int32 ordered scores written (+ the list
or the page-table entries read), over the live candidates.

Each shape also times the selection by torch.topk over the same ordered scores beside the
select kernel: indexer_topk takes the select kernel up to indexer.SELECT_MAX_WIDTH candidates a
row and torch.topk over int64 keys beyond (what these rows measure). Decode rows keep the captured width C of a decode
graph (context_length / 4) with fewer live candidates: a row with at most 512 of them needs no
selection."""

import torch

from common import report, require_cuda, time_ms

NH, DI, TOPK = 64, 128, 512

# (tokens, width C, live candidates per row)
SHAPES = (
    (1, 2048, 256), (1, 2048, 2048), (64, 2048, 256), (64, 2048, 2048),  # decode graphs
    (1, 32768, 32768), (64, 16384, 16384),  # long contexts
    (1024, 4096, 4096), (1024, 16384, 16384),  # prefill chunks
)


def main():
    if not require_cuda():
        return
    from dsv4_kernels import PageTableList, indexer

    keys = torch.randn(1 << 18, DI, device="cuda", dtype=torch.bfloat16)
    print(f"== indexer (nH={NH}, Di={DI}, topk={TOPK})")
    for T, C, live in SHAPES:
        q = torch.randn(T, NH, DI, device="cuda", dtype=torch.bfloat16)
        w = torch.rand(T, NH, device="cuda")
        lens = torch.full((T,), live, device="cuda", dtype=torch.int32)
        out = torch.empty(T, TOPK, device="cuda", dtype=torch.int32)
        nbytes = T * live * (DI * 2 + 4 + 4) + q.numel() * 2
        flops = 2 * T * NH * live * DI
        # a page table: 8 requests of 4C positions in shuffled 128-token pages
        pages = torch.randperm(keys.shape[0] * 4 // 128, device="cuda")[: 8 * 4 * C // 128].view(8, -1)
        pos = torch.arange(4 * C, device="cuda")
        rtt = (pages[:, pos // 128] * 128 + pos % 128).int()
        cands = PageTableList(rtt, torch.randint(0, 8, (T,), device="cuda", dtype=torch.int32), 4, C)
        tag = f"T={T} C={C} live={live}"
        ordered = torch.empty(T, C, device="cuda", dtype=torch.int32)
        ms = time_ms(lambda: indexer.indexer_logits(q, w, keys, cands, lens, ordered, out="ordered"), graph=True)
        report(f"logits (page table) {tag}", ms, nbytes, flops)
        k = min(TOPK, C)
        ms = time_ms(lambda: ordered.topk(k, dim=-1, sorted=False), graph=True)
        report(f"  torch.topk over them {tag}", ms)
        ms = time_ms(lambda: indexer.select_topk_slots(ordered, cands, lens, TOPK, out), graph=True)
        report(f"  select kernel {tag}", ms)
        ms = time_ms(lambda: indexer.indexer_topk(q, w, keys, cands, lens, TOPK, out), graph=True)
        report(f"indexer_topk (logits + select) {tag}", ms, nbytes, flops)
        if T * C <= 1 << 24:  # the materialized list, for comparison
            slots = cands.gather(lens)
            ms = time_ms(lambda: indexer.indexer_topk(q, w, keys, slots, lens, TOPK, out), graph=True)
            report(f"indexer_topk over a [T, C] list {tag}", ms, nbytes, flops)


if __name__ == "__main__":
    main()
