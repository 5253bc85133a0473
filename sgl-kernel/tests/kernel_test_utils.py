"""Shared helpers of the kernel tests (random inputs that look like real metadata)."""

import pytest
import torch


def require_triton():
    return pytest.importorskip("triton", reason="triton is not installed: Triton kernels untested")


def random_index_lists(num_tokens, width, pool_size, lengths, pad_prob=0.1, device="cpu"):
    """[T, width] int32 slots: random rows of the pool, some -1 padding inside each length,
    and garbage (random slots, never read) beyond the length."""
    idx = torch.randint(0, pool_size, (num_tokens, width), dtype=torch.int32, device=device)
    pad = torch.rand(num_tokens, width, device=device) < pad_prob
    idx[pad] = -1
    return idx, torch.as_tensor(lengths, dtype=torch.int32, device=device)


def rope_tables(max_pos, rope_dim, theta=10000.0, device="cpu"):
    freqs = theta ** (-torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
    angles = torch.arange(max_pos, dtype=torch.float64)[:, None] * freqs[None, :]
    return angles.cos().float().to(device), angles.sin().float().to(device)


def paged_page_table(num_rows, context, page_size=128, device="cpu", seed=0):
    """[num_rows, context] int32 page table as the runtime's: each row's positions in whole
    pages of shuffled page ids (so raw // r is unique per compressed entry, for r | page_size).
    The pool behind it has num_rows * context / page_size pages."""
    assert context % page_size == 0
    g = torch.Generator().manual_seed(seed)
    pages_per_row = context // page_size
    pages = torch.randperm(num_rows * pages_per_row, generator=g).view(num_rows, pages_per_row)
    pos = torch.arange(context)
    rtt = pages[:, pos // page_size] * page_size + pos % page_size
    return rtt.to(torch.int32).to(device)


def fp4_experts(E, d, inter, device):
    """E experts' FP4 weights and scales (w1, s1, w3, s3, w2, s2) at dims d / inter, drawn on
    the CPU with unit-variance outputs and quantized by quant_reference."""
    from dsv4_kernels import quant_reference as Q

    def q(o, i, gain):
        p, s = Q.quantize_fp4(torch.randn(E, o, i) * gain)
        return p.to(device), s.to(device)
    (w1, s1), (w3, s3), (w2, s2) = q(inter, d, d ** -0.5), q(inter, d, d ** -0.5), \
        q(d, inter, inter ** -0.5)
    return w1, s1, w3, s3, w2, s2


def distinct_expert_ids(T, topk, low, high, device):
    """[T, topk] distinct per row in [low, high) (outside [0, E): another shard, or -1)."""
    ids = torch.rand(T, high - low).argsort(dim=1)[:, :topk] + low
    return ids.to(torch.int32).to(device)
