"""Packed FP4 indexer keys (plain torch): the byte layout of one cached indexer key whose values
are FP4-rounded per 32 (the release numerics' rounding of the indexer's compressed KV), and
its pack / unpack ground truth for the Triton kernels.

One uint8 row per key, for dim D (a multiple of 32):

    [0, D/2)           e2m1 codes, two per byte: element 2j in the low nibble, 2j+1 in the high
                       one; bit 3 of a code is the sign, bits 0-2 index E2M1_VALUES
    [D/2, D/2 + D/32)  one e8m0 byte per 32 elements: scale = 2^(byte - 127)

D = 128: 64 + 4 = 68 bytes (a bf16 key: 256, fp32: 512). The codes are the release's expert
format (quant_reference.pack_fp4's nibble order).

`pack(x)` rounds as quant_reference.fp4_round_blocks does (scale: the power of two >= amax/6 of
each block, amax floored; magnitudes to the e2m1 grid, ties to even; a negative value that
rounds to zero stays -0.0), so unpack(pack(x)) == fp4_round_blocks(x) bit for bit, except that
a -0.0 in x stays -0.0 (fp4_round_blocks gives +0.0: the same value). An x that already is
FP4-rounded per 32 therefore comes back bit for bit: the block's rounded amax leads to its scale
or half of it, and the block's values lie on the e2m1 grid of either. Nothing checks that x was
rounded (a check would read the device back to the host): an unrounded x is stored rounded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .quant_reference import E2M1_MAX, FP4_BLOCK, _round_e2m1, e8m0_to_fp32, pow2_scale


@dataclass(frozen=True)
class IndexKeyFP4Layout:
    """Where each part of a packed key lives. Rows are uint8 [N, row_bytes]."""

    dim: int

    def __post_init__(self):
        if self.dim <= 0 or self.dim % FP4_BLOCK:
            raise ValueError(f"FP4 indexer keys: index_head_dim {self.dim} must be a positive multiple of "
                             f"{FP4_BLOCK} (one scale per {FP4_BLOCK})")

    @property
    def scale_offset(self) -> int:
        return self.dim // 2

    @property
    def num_scales(self) -> int:
        return self.dim // FP4_BLOCK

    @property
    def row_bytes(self) -> int:
        return self.scale_offset + self.num_scales

    @classmethod
    def of_rows(cls, rows: torch.Tensor, dim: int) -> "IndexKeyFP4Layout":
        layout = cls(dim)
        layout.check_rows(rows)
        return layout

    def check_rows(self, rows: torch.Tensor, what: str = "FP4 indexer keys") -> None:
        if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] != self.row_bytes or rows.stride(1) != 1:
            raise ValueError(f"{what}: expected uint8 [N, {self.row_bytes}] rows with unit inner stride for "
                             f"dim {self.dim}, got {rows.dtype} {tuple(rows.shape)}")

    def codes(self, rows: torch.Tensor) -> torch.Tensor:
        return rows[..., :self.scale_offset]

    def scales(self, rows: torch.Tensor) -> torch.Tensor:
        return rows[..., self.scale_offset:self.row_bytes]

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, dim] (any float dtype) -> uint8 [N, row_bytes], rounded as fp4_round_blocks.
        Static shapes, no host sync, no table copied to the device: graph capturable."""
        if x.shape[-1] != self.dim:
            raise ValueError(f"FP4 indexer keys: rows of {x.shape[-1]} values for dim {self.dim}")
        xb = x.float().unflatten(-1, (self.num_scales, FP4_BLOCK))
        scale = pow2_scale(xb.abs().amax(dim=-1), E2M1_MAX)
        v = xb / scale[..., None]
        mag = _round_e2m1(v.abs().clamp(max=E2M1_MAX))
        # magnitude -> code 0..7 of E2M1_VALUES: 0, .5, 1, 1.5 -> 2m; 2, 3 -> m + 2; 4, 6 -> m / 2 + 4
        code = torch.where(mag < 2, 2 * mag, torch.where(mag < 4, mag + 2, mag / 2 + 4)).to(torch.uint8)
        code = (code | (torch.signbit(v).to(torch.uint8) << 3)).flatten(-2)
        rows = torch.empty(*x.shape[:-1], self.row_bytes, dtype=torch.uint8, device=x.device)
        self.codes(rows).copy_(code[..., 0::2] | (code[..., 1::2] << 4))
        # pow2_scale's results are normal powers of two (amax is floored): the exponent byte
        # is the whole e8m0 encoding
        self.scales(rows).copy_(((scale.view(torch.int32) >> 23) & 0xFF).to(torch.uint8))
        return rows

    def unpack(self, rows: torch.Tensor) -> torch.Tensor:
        """uint8 [..., row_bytes] -> fp32 [..., dim] (exact: an e2m1 value times a power of two)."""
        b = self.codes(rows).to(torch.int32)
        code = torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2)
        mag = code & 7
        e, m = mag >> 1, (mag & 1).float()
        v = torch.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * torch.exp2((e - 1).float()))
        v = torch.where((code & 8) != 0, -v, v)  # code 8 is -0.0, as the rounding gave it
        scale = e8m0_to_fp32(self.scales(rows))
        return (v.unflatten(-1, (self.num_scales, FP4_BLOCK)) * scale[..., None]).flatten(-2)


def index_key_row_bytes(dim: int, fp4: bool, dtype: torch.dtype) -> int:
    """Bytes of one cached indexer key: a packed FP4 row, or dim elements of dtype."""
    return IndexKeyFP4Layout(dim).row_bytes if fp4 else dim * dtype.itemsize
