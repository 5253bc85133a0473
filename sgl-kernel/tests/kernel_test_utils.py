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
