"""Per-token lists of compressed-pool slots read through the page table, never materialized.

Compressed entry i (ratio r) of a request lives at slot `rtt[row, r*i + r - 1] // r` of the
ratio-r pool (the raw slot of the entry's last token, divided by r; unique because pages are
128-aligned). A token at position p sees entries i < (p + 1) // r, so a materialized list
would be [T, context / r]: 4.3 GB per 4096-token step at a 1M context for the c4 candidates.
Kernels take a `PageTableList` instead and read each entry from the page table as they need
it; the torch references gather a bounded chunk of tokens at a time with `gather` (the one
torch version of the formula).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class PageTableList:
    """Entry i of token t: rtt[rows[t], ratio * i + ratio - 1] // ratio. Valid for i below the
    caller's per-token length (which must not exceed `width`); entries past it are never read.

    rtt: [num_rows, max_context] int32 page table (raw slots). rows: [T] its row per token
    (padding tokens: any row, with length 0). width: host int bounding every length (the
    width of a gathered list, of the indexer's logits)."""

    rtt: torch.Tensor
    rows: torch.Tensor
    ratio: int
    width: int

    def __post_init__(self):
        if self.rtt.dim() != 2 or self.rows.dim() != 1:
            raise ValueError(f"PageTableList needs a 2-D page table and 1-D rows, got rtt "
                             f"{tuple(self.rtt.shape)} and rows {tuple(self.rows.shape)}")
        if self.rtt.dtype not in (torch.int32, torch.int64) or self.rows.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"PageTableList needs integer rtt and rows, got {self.rtt.dtype} / {self.rows.dtype}")
        if self.ratio < 1 or self.width < 0:
            raise ValueError(f"PageTableList needs ratio >= 1 and width >= 0, got {self.ratio} / {self.width}")

    @property
    def num_tokens(self) -> int:
        return self.rows.shape[0]

    def __getitem__(self, tokens: slice) -> "PageTableList":
        """The lists of a slice of the tokens (same page table, ratio and width)."""
        if not isinstance(tokens, slice):
            raise TypeError(f"PageTableList can only be sliced by tokens, got {type(tokens).__name__}")
        if tokens.indices(self.num_tokens) == (0, self.num_tokens, 1):
            return self  # every token: the common one-chunk case of each break, without a rebuild
        return replace(self, rows=self.rows[tokens])

    def slots_at(self, cols: torch.Tensor) -> torch.Tensor:
        """int64 slots of entries `cols` ([T, k], or [k] for every token) of each token's list
        (-1 where the page table holds a negative slot). Columns are clamped into the page
        table; callers mask what lies past the length."""
        cols = cols.long()
        cols = cols if cols.dim() == 2 else cols[None, :].expand(self.num_tokens, -1)
        raw = self.rtt[self.rows.long()[:, None], (self.ratio * cols + self.ratio - 1).clamp(max=self.rtt.shape[1] - 1)]
        raw = raw.long()
        return torch.where(raw >= 0, raw // self.ratio, -1)  # an unmapped (negative) raw slot is -1

    def gather(self, lengths: torch.Tensor) -> torch.Tensor:
        """The materialized lists [T, width] int32: entry i where i < lengths[t], else -1."""
        cols = torch.arange(self.width, device=self.rows.device)
        live = cols[None, :] < lengths.long()[:, None]
        return torch.where(live, self.slots_at(cols), -1).to(torch.int32)


def list_width(idx) -> int:
    """Width of an index list: a [T, W] tensor's W, or a PageTableList's width."""
    return idx.width if isinstance(idx, PageTableList) else idx.shape[1]


@dataclass(frozen=True)
class KernelListArgs:
    """An index list as the Triton kernels take it: `table` rows of `width` entries, either a
    [T, W] slot list (row t) or, when `paged`, the page table read at `rows[t]` with `ratio`
    (load_page_table_slots, which clamps columns at `max_col`)."""

    table: torch.Tensor
    rows: torch.Tensor
    width: int
    max_col: int
    paged: bool
    ratio: int


def kernel_list_args(idx, length: torch.Tensor, num_tokens: int) -> KernelListArgs:
    """KernelListArgs of a [T, W] slot list or a PageTableList of `num_tokens` tokens (for a
    plain list, `length` stands in for the rows, which the kernels never read)."""
    if isinstance(idx, PageTableList):
        assert idx.num_tokens == num_tokens and idx.rtt.stride(-1) == 1
        return KernelListArgs(idx.rtt, idx.rows, idx.width, idx.rtt.shape[1] - 1, True, idx.ratio)
    assert idx.stride(-1) == 1
    return KernelListArgs(idx, length, idx.shape[1], idx.shape[1] - 1, False, 1)
