"""sparse_attn_with_sink at dsv4-flash-slice decode shapes (H=64, D=512, window 128, c4 top-k
512): achieved bandwidth over gathered KV rows + q + out, for the default and a config sweep,
the default config reading an FP8 KV cache (584-byte rows, dequantized on load), and list b
read through the page table as the c128 entries are (PageTableList, 512 entries = 64K tokens);
the config sweep runs over bf16 rows and again over FP8 rows. Then one decode token (FP8 rows,
CUDA-graph replay) with the lists a Flash layer of each kind reads: the window alone, the window
and a second list of 8 to 512 live entries (slot lists as the indexer's top-k, page-table lists
as the c128 entries), and the window + top-256 case at each split count: what a list costs
beside what its bytes cost. `--tokens 1 64` times those token counts only."""

import argparse

import torch

from common import report, require_cuda, time_ms

H, D, WA, WB = 64, 512, 128, 512
POOL_ROWS = 1 << 16  # 64 MiB of bf16 rows per pool: random gathers miss L2

SWEEP = [  # (block_h, block_n, num_warps, num_stages, keys_as_m); sm90_resources.py shows spills
    (32, 32, 8, 2, False), (32, 16, 8, 2, False), (32, 32, 8, 3, False), (16, 32, 4, 2, False),
    (16, 32, 4, 3, False), (16, 16, 4, 2, False), (64, 32, 8, 2, False), (64, 32, 8, 2, True),
    # 16-head blocks in 8 warps: the decode tier's FP8 tiles, and in 16-key blocks the one FP8
    # config that does not spill at all
    (16, 32, 8, 2, False), (16, 16, 8, 2, False),
    # keys as the 64-row M side of the first dot (Hopper's natural wgmma tile), deeper pipelines
    (64, 64, 8, 2, True), (64, 64, 8, 3, True), (64, 32, 8, 3, True), (64, 32, 8, 4, True),
    (64, 16, 4, 3, True), (64, 64, 4, 2, True),
    # the FP8 tiles of the T > 255 tier (configs/sparse_attention_tiles.json)
    (64, 16, 8, 2, True),
]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 256, 1024], help="tokens per launch")
    p.add_argument("--long-context", type=int, nargs="*", metavar="CONTEXT",
                   help="only the decode steps of requests this long (default 8192 131072): the bytes each layer "
                        "kind's lists read against the time, at 1, 16 and 64 requests")
    opts = p.parse_args()
    if not require_cuda():
        return
    if opts.long_context is not None:
        long_context(opts.long_context or [8192, 131072])
        return
    from dsv4_kernels import PageTableList, ops, reference
    from dsv4_kernels.sparse_attention import sparse_attn_with_sink

    from dsv4_kernels.kv_fp8 import FP8KVLayout

    kv_a = torch.randn(POOL_ROWS, D, device="cuda", dtype=torch.bfloat16)
    kv_b = torch.randn(POOL_ROWS, D, device="cuda", dtype=torch.bfloat16)
    layout = FP8KVLayout(D, 64)
    kv_a8, kv_b8 = layout.pack(kv_a), layout.pack(kv_b)  # the same keys as FP8 rows
    sink = torch.randn(H, device="cuda")
    scale = D ** -0.5
    print(f"== sparse_attn_with_sink H={H} D={D} Wa={WA} Wb={WB} (decode: every entry valid)")
    for T in opts.tokens:
        q = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16)
        idx_a = torch.randint(0, POOL_ROWS, (T, WA), device="cuda", dtype=torch.int32)
        idx_b = torch.randint(0, POOL_ROWS, (T, WB), device="cuda", dtype=torch.int32)
        len_a = torch.full((T,), WA, device="cuda", dtype=torch.int32)
        len_b = torch.full((T,), WB, device="cuda", dtype=torch.int32)
        out = torch.empty_like(q)
        args = (q, kv_a, idx_a, len_a, kv_b, idx_b, len_b, sink, scale, out)
        nbytes = T * (WA + WB) * D * 2 + 2 * q.numel() * 2
        flops = 4 * T * H * (WA + WB) * D
        if T <= 64:  # once per shape: the kernel agrees with the reference here
            expected = reference.sparse_attn_with_sink(*args[:-1], torch.empty(T, H, D, device="cuda"))
            ops.sparse_attn_with_sink(*args)
            err = (out.float() - expected).abs().max().item()
            assert err < 3e-2, f"mismatch {err}"
        # Eagerly (a break) the key lists split only into >= 4 key blocks each; captured (decode
        # graphs) the wave alone decides: both rows show what that choice costs on the GPU.
        report(f"T={T:<5} default, eager", time_ms(lambda: ops.sparse_attn_with_sink(*args)), nbytes, flops)
        report(f"T={T:<5} default, in a CUDA graph", time_ms(lambda: ops.sparse_attn_with_sink(*args), graph=True),
               nbytes, flops)
        args8 = (q, kv_a8, idx_a, len_a, kv_b8, idx_b, len_b, sink, scale, out)
        if T <= 64:
            expected = reference.sparse_attn_with_sink(*args8[:-1], torch.empty(T, H, D, device="cuda"),
                                                       kv_layout=layout)
            ops.sparse_attn_with_sink(*args8, kv_layout=layout)
            err = (out.float() - expected).abs().max().item()
            assert err < 3e-2, f"fp8 kv mismatch {err}"
        nbytes8 = T * (WA + WB) * layout.row_bytes + 2 * q.numel() * 2
        report(f"T={T:<5} default, fp8 kv cache", time_ms(lambda: ops.sparse_attn_with_sink(*args8, kv_layout=layout)),
               nbytes8, flops)
        # list b as c128 entries of 64K-token requests, through a page table of shuffled pages
        pages = torch.randperm(POOL_ROWS, device="cuda")[: 8 * WB].view(8, WB)
        pos = torch.arange(128 * WB, device="cuda")
        rtt = (pages[:, pos // 128] * 128 + pos % 128).int()
        c128 = PageTableList(rtt, torch.randint(0, 8, (T,), device="cuda", dtype=torch.int32), 128, WB)
        args_pt = (q, kv_a, idx_a, len_a, kv_b, c128, len_b, sink, scale, out)
        report(f"T={T:<5} default, b through the page table", time_ms(lambda: ops.sparse_attn_with_sink(*args_pt)),
               nbytes, flops)
        splits = (1, 2, 4, 8, 16) if T <= 64 else (1, 2) if T <= 256 else (1,)
        sweep(f"T={T:<5} best", lambda cfg: sparse_attn_with_sink(*args, config=cfg), splits, nbytes, flops)
        # The same sweep over the FP8 KV cache (the default with release numerics): its in-kernel
        # dequantization needs registers of its own, so its best tiles differ (kv_fp8_tiles).
        sweep(f"T={T:<5} fp8 kv best", lambda cfg: sparse_attn_with_sink(*args8, config=cfg, kv_layout=layout),
              splits, nbytes8, flops)
    decode_lists(kv_a8, kv_b8, layout, sink, scale)


def long_context(contexts):
    """Decode steps (graph replay, FP8 rows, the model's configs) of requests `context` tokens
    long: a ratio-4 layer reads the window and the indexer's top-512 compressed rows, a ratio-128
    layer the window and context / 128 compressed rows through the page table. Every request's
    rows are distinct pool rows, so the bytes are HBM bytes; the share of the copy ceiling is the
    figure to judge (the field's FP8 sparse decode kernels sit near 90% of HBM for dense decode)."""
    from dsv4_kernels import PageTableList, ops
    from dsv4_kernels.kv_fp8 import FP8KVLayout

    layout = FP8KVLayout(D, 64)
    print(f"== decode at long context: H={H} D={D}, FP8 rows of {layout.row_bytes} B, window {WA}, graph replay "
          f"({torch.cuda.get_device_name()})")
    for context in contexts:
        c128 = context // 128
        for batch in (1, 16, 64):
            rows_needed = batch * max(WA + WB, c128)
            kv = layout.pack(torch.randn(rows_needed, D, device="cuda", dtype=torch.bfloat16))
            perm = torch.randperm(rows_needed, device="cuda", dtype=torch.int32)
            window = perm[: batch * WA].view(batch, WA)
            q = torch.randn(batch, H, D, device="cuda", dtype=torch.bfloat16)
            out = torch.empty_like(q)
            sink = torch.randn(H, device="cuda")

            def full(n):
                return torch.full((batch,), n, device="cuda", dtype=torch.int32)

            topk = perm[batch * WA: batch * (WA + WB)].view(batch, WB)
            pages = torch.randperm(rows_needed, device="cuda")[: batch * c128].view(batch, c128)
            pos = torch.arange(context, device="cuda")
            rtt = (pages[:, pos // 128] * 128 + pos % 128).int()
            by_page = PageTableList(rtt, torch.arange(batch, device="cuda", dtype=torch.int32), 128, c128)
            for kind, idx_b, keys_b in (("ratio 4, window + top-512", topk, WB),
                                        (f"ratio 128, window + {c128} c128 rows", by_page, c128)):
                args = (q, kv, window, full(WA), kv, idx_b, full(keys_b), sink, D ** -0.5, out)
                nbytes = batch * (WA + keys_b) * layout.row_bytes + 2 * q.numel() * 2
                report(f"ctx {context:>6} x{batch:<3} {kind}",
                       time_ms(lambda: ops.sparse_attn_with_sink(*args, kv_layout=layout), graph=True), nbytes)
            del kv, rtt


def decode_lists(kv_a8, kv_b8, layout, sink, scale):
    """One token, FP8 rows, graph replay: the time of each list shape a decode layer reads."""
    from dsv4_kernels import PageTableList, ops
    from dsv4_kernels.sparse_attention import SparseAttnConfig, measured_config, sparse_attn_with_sink

    print(f"== one decode token, FP8 rows, graph replay (default: {measured_config(1, kv_fp8=True)})")
    q = torch.randn(1, H, D, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    window = torch.randint(0, POOL_ROWS, (1, WA), device="cuda", dtype=torch.int32)
    def full(n):  # a one-token length
        return torch.full((1,), n, device="cuda", dtype=torch.int32)

    def slots(width, live):
        idx = torch.full((1, width), -1, device="cuda", dtype=torch.int32)
        idx[:, :live] = torch.randint(0, POOL_ROWS, (1, live), device="cuda", dtype=torch.int32)
        return idx

    pos = torch.arange(128 * 64, device="cuda")
    pages = torch.randperm(POOL_ROWS // 128, device="cuda")[:64]
    rtt = (pages[pos // 128] * 128 + pos % 128).int()[None]
    c128 = PageTableList(rtt, torch.zeros(1, device="cuda", dtype=torch.int32), 128, 64)
    cases = {"window (128) alone": (None, None, None)}
    for width, live in ((512, 8), (512, 256), (512, 512)):
        cases[f"window + top-k slots, {live} live of {width}"] = (kv_b8, slots(width, live), full(live))
    for live in (8, 64):
        cases[f"window + c128 page-table list, {live} live"] = (kv_b8, c128, full(live))
    for name, (kv_b, idx_b, len_b) in cases.items():
        args = (q, kv_a8, window, full(WA), kv_b, idx_b, len_b, sink, scale, out)
        keys = WA + (0 if len_b is None else int(len_b.item()))
        report(name, time_ms(lambda: ops.sparse_attn_with_sink(*args, kv_layout=layout), graph=True),
               keys * layout.row_bytes + 2 * q.numel() * 2)
    idx_b = slots(512, 256)
    for n in (4, 8, 16):
        cfg = SparseAttnConfig(block_h=16, block_n=32, num_warps=8, num_stages=2, num_splits=n)
        args = (q, kv_a8, window, full(WA), kv_b8, idx_b, full(256), sink, scale, out)
        report(f"window + top-256, {n} splits", time_ms(
            lambda: sparse_attn_with_sink(*args, config=cfg, kv_layout=layout), graph=True),
            (WA + 256) * layout.row_bytes + 2 * q.numel() * 2)


def sweep(label, run, splits, nbytes, flops):
    """Every SWEEP config at every split count through run(config); reports the fastest."""
    from dsv4_kernels.sparse_attention import SparseAttnConfig

    best = None
    for bh, bn, nw, ns, keys_as_m in SWEEP:
        for n in splits:
            cfg = SparseAttnConfig(bh, bn, nw, ns, n, keys_as_m)
            try:
                ms = time_ms(lambda: run(cfg), iters=10)
            except Exception as e:  # a config that does not fit (registers, smem) is skipped
                print(f"   {label} {cfg}: failed ({type(e).__name__})")
                continue
            if best is None or ms < best[0]:
                best = (ms, cfg)
    ms, cfg = best
    report(f"{label} h{cfg.block_h} n{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages} "
           f"splits{cfg.num_splits}{' keys_as_m' if cfg.keys_as_m else ''}", ms, nbytes, flops)

if __name__ == "__main__":
    main()
