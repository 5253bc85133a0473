"""The one DSV4 op the model's own segment code keeps outside sgl-kernel: the static-shape
row scatter with a trash row. Every other torch formula (compressor pooling, indexer top-k,
the attention core) is dsv4_kernels.reference, which the layers call directly when the
segment kernels are off (CPU, --segment-kernels off) and the Triton ops replace when on."""

from __future__ import annotations

import torch


def scatter_rows_(dst: torch.Tensor, loc: torch.Tensor, rows: torch.Tensor, trash: int) -> None:
    """dst[loc] = rows, with -1 locations sent to a trash row nobody reads (static shape)."""
    safe = torch.where(loc >= 0, loc, trash).long()
    dst.index_put_((safe,), rows.to(dst.dtype))
