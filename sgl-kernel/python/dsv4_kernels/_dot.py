"""Dot precision chosen per input dtype: fp32 inputs (tests, CPU-style fp32 models) are
multiplied exactly ("ieee"); bf16 inputs keep the default so tensor cores are always used."""

import torch


def dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"
