"""FP8 KV-cache rows (plain torch): the byte layout of one cached KV entry with the nope dims in
e4m3, and its pack (quantize) / unpack (dequantize) ground truth for the Triton kernels.

One uint8 row per entry (window token or compressed entry), for head_dim D = nope + rope:

    [0, nope)                      e4m3 codes of the nope dims
    [nope, nope + rope * esize)    the rope dims (RoPE applied) in rope_dtype: the model dtype
    [.. , .. + nope / 64)          one e8m0 byte per 64 nope dims: scale = 2^(byte - 127)
    zero padding up to a multiple of 8 bytes

DeepSeek-V4 in bf16 (D = 512, rope 64): 448 + 128 + 7 + 1 = 584 bytes, the release kernels'
size per token per entry (bf16 rows: 1024). An fp32 model (CPU) keeps its rope dims in fp32
(712 bytes; rope_dim >= 4 keeps the two widths apart), so that an FP8 cache holds exactly what release rounding with a float cache
holds. The rope part starts 64-byte aligned (nope is whole 64-blocks) and the scales sit at
the end so both value parts stay aligned. Quantization is quant_reference's: a power-of-two
scale >= amax/448 per 64 dims (amax floored), e4m3 round to nearest even.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .quant_reference import e8m0_to_fp32, fp8_round_blocks, quantize_fp8_blocks

KV_FP8_BLOCK = 64  # nope dims per scale (the release's KV quantization block)
ROW_ALIGN = 8
ROPE_DTYPES = (torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class FP8KVLayout:
    """Where each part of an FP8 KV row lives. Rows are uint8 [N, row_bytes]."""

    head_dim: int
    rope_dim: int
    rope_dtype: torch.dtype = torch.bfloat16

    def __post_init__(self):
        nope = self.head_dim - self.rope_dim
        if self.rope_dim < 0 or self.rope_dim % 2 or nope <= 0 or nope % KV_FP8_BLOCK:
            raise ValueError(
                f"FP8 KV cache: head_dim {self.head_dim} - rope_dim {self.rope_dim} = {nope} nope "
                f"dims must be a positive multiple of {KV_FP8_BLOCK} (one scale per {KV_FP8_BLOCK}) "
                f"and rope_dim even")
        if self.rope_dtype not in ROPE_DTYPES:
            raise ValueError(f"FP8 KV cache: rope dims are stored in the model dtype, one of "
                             f"{ROPE_DTYPES}; got {self.rope_dtype}")

    @classmethod
    def of_rows(cls, rows: torch.Tensor, head_dim: int, rope_dim: int) -> "FP8KVLayout":
        """The layout whose row width rows has (bf16 or fp32 rope dims: the widths differ by
        2 * rope_dim >= 8 bytes, so the width decides; for rope_dim 0 the two are one layout)."""
        for dtype in ROPE_DTYPES:
            layout = cls(head_dim, rope_dim, dtype)
            if rows.shape[-1] == layout.row_bytes:
                return layout
        raise ValueError(f"a uint8 KV pool of width {rows.shape[-1]} is no FP8 KV row layout for "
                         f"head_dim {head_dim}, rope_dim {rope_dim} (bf16 rope: "
                         f"{cls(head_dim, rope_dim).row_bytes} bytes)")

    @property
    def nope_dim(self) -> int:
        return self.head_dim - self.rope_dim

    @property
    def num_scales(self) -> int:
        return self.nope_dim // KV_FP8_BLOCK

    @property
    def rope_offset(self) -> int:
        return self.nope_dim

    @property
    def scale_offset(self) -> int:
        return self.nope_dim + self.rope_dim * self.rope_dtype.itemsize

    @property
    def row_bytes(self) -> int:
        return -(-(self.scale_offset + self.num_scales) // ROW_ALIGN) * ROW_ALIGN

    def check_rows(self, rows: torch.Tensor, what: str = "FP8 KV rows") -> None:
        if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] != self.row_bytes \
                or rows.stride(1) != 1:
            raise ValueError(f"{what}: expected uint8 [N, {self.row_bytes}] rows with unit inner "
                             f"stride for head_dim {self.head_dim} / rope_dim {self.rope_dim}, got "
                             f"{rows.dtype} {tuple(rows.shape)}")

    # ---- views of a row tensor (share its storage) -----------------------------------------
    def nope(self, rows: torch.Tensor) -> torch.Tensor:
        """float8_e4m3fn [N, nope] (the codes, not yet scaled)."""
        return rows[:, :self.nope_dim].view(torch.float8_e4m3fn)

    def rope(self, rows: torch.Tensor) -> torch.Tensor:
        """rope_dtype [N, rope]."""
        return rows[:, self.rope_offset:self.scale_offset].view(self.rope_dtype)

    def scales(self, rows: torch.Tensor) -> torch.Tensor:
        """uint8 e8m0 bytes [N, nope / 64]."""
        return rows[:, self.scale_offset:self.scale_offset + self.num_scales]

    # ---- ground truth ------------------------------------------------------------------------
    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, head_dim] (any float dtype) -> uint8 [N, row_bytes]: nope dims quantized per 64
        (quantize_fp8_blocks), rope dims cast to rope_dtype, padding zero. No host sync."""
        q, scale = quantize_fp8_blocks(x[:, :self.nope_dim].float(), KV_FP8_BLOCK)
        rows = torch.zeros(x.shape[0], self.row_bytes, dtype=torch.uint8, device=x.device)
        rows[:, :self.nope_dim] = q.view(torch.uint8)
        rows[:, self.rope_offset:self.scale_offset] = \
            x[:, self.nope_dim:].to(self.rope_dtype).contiguous().view(torch.uint8)
        # pow2_scale's scales are normal powers of two (amax is floored): the exponent byte is
        # the whole e8m0 encoding (fp32_to_e8m0 would also check that, with a host sync).
        rows[:, self.scale_offset:self.scale_offset + self.num_scales] = \
            ((scale.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
        return rows

    def unpack(self, rows: torch.Tensor) -> torch.Tensor:
        """uint8 [..., row_bytes] -> fp32 [..., head_dim] (exact: e4m3 times a power of two)."""
        flat = rows.reshape(-1, self.row_bytes)
        nope = self.nope(flat).float().unflatten(-1, (self.num_scales, KV_FP8_BLOCK))
        nope = (nope * e8m0_to_fp32(self.scales(flat))[..., None]).flatten(-2)
        out = torch.cat([nope, self.rope(flat).float()], dim=-1)
        return out.reshape(*rows.shape[:-1], self.head_dim)


def round_nope_fp8(x: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """What an FP8 row holds, in x's dtype: the nope dims FP8-rounded per 64 (quantize then
    dequantize), the rope dims unchanged. The release numerics' rounding for a float cache."""
    nope = x.shape[-1] - rope_dim
    FP8KVLayout(x.shape[-1], rope_dim)  # validates the split
    return torch.cat([fp8_round_blocks(x[..., :nope], KV_FP8_BLOCK), x[..., nope:]], dim=-1)


def kv_row_bytes(head_dim: int, rope_dim: int, kv_cache_dtype: str, dtype: torch.dtype) -> int:
    """Bytes of one cached KV entry of a model in `dtype`: an FP8 row for "fp8_e4m3", else
    head_dim elements of dtype."""
    if kv_cache_dtype == "fp8_e4m3":
        return FP8KVLayout(head_dim, rope_dim, dtype).row_bytes
    return head_dim * dtype.itemsize
