"""DSV4 attention metadata. Each field declares its breakable-CUDA-graph class
(see field_classes.py). Shapes: T = tokens of the (possibly padded) batch; E = emissions
(compressed entries produced this step, padded to a static bound under capture)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from dsv4_kernels.page_table_list import PageTableList

from sglang.srt.layers.attention.dsv4.field_classes import (
    assign_field,
    copy_field,
    produced_field,
    refresh_,
    static_field,
)


class _Refreshable:
    def refresh_for_breakable_cuda_graph_replay_(self, fresh) -> None:
        refresh_(self, fresh)

    def refresh_for_decode_cuda_graph_replay_(self, fresh) -> None:
        refresh_(self, fresh, full_graph=True)


@dataclass
class DSV4CompressorMetadata(_Refreshable):
    """One per ratio; the c4 layers' main and indexer compressors share it (same ring layout)."""

    ratio: int = static_field()
    # [E, R] source rows: >= 0 ring-state row, <= -2 fresh token (-idx-2), -1 empty
    gather_idx: torch.Tensor = copy_field()
    out_loc: torch.Tensor = copy_field()  # [E] compressed-pool slot (c4_out_loc / c128_out_loc); -1 pad
    positions: torch.Tensor = copy_field()  # [E] RoPE position of each entry (i * ratio)
    ring_write_loc: torch.Tensor = copy_field()  # [T] flat ring row, -1 = keep nothing


@dataclass
class DSV4IndexerMetadata(_Refreshable):
    """The c4 candidates of token t are entries i < cand_len[t], read through the page table
    (DSV4Metadata.page_table_list(rtt, 4, ...), cand_width wide): no [T, context / 4] list
    exists."""

    topk: int = static_field()
    # host int: the widest candidate list of the live batch (its longest sequence // 4; in full
    # decode graphs context // 4): the width of the break's logits chunk (widths.py)
    cand_width: int = assign_field()
    cand_len: torch.Tensor = copy_field()  # [T] visible c4 entries: floor((pos+1)/4)
    topk_len: torch.Tensor = copy_field()  # [T] min(topk, cand_len): the c4 top-k lengths
    topk_slots: torch.Tensor = produced_field()  # [T, topk] written by the break's top-k, read by its attention


@dataclass
class DSV4AttnMetadata(_Refreshable):
    """Read only by the eager attention break: replaced wholesale at replay. The c128 entries
    of token t are i < c128_len[t], read through the page table (page_table_list)."""

    # [T, window] raw rows of each query's window, left-aligned, -1 pad: this step's positions
    # in their staging rows, older ones in the request's ring (DSV4KVPool)
    window_slots: torch.Tensor = assign_field()
    window_len: torch.Tensor = assign_field()  # [T]
    # [T] ring row the token's staging row moves to once the layer's windows are read (its own
    # staging row when it is not among its request's last `window` positions, and for padding)
    raw_keep_loc: torch.Tensor = assign_field()
    c128_len: torch.Tensor = assign_field()  # [T]
    # host int: the live batch's longest sequence // 128 (full decode graphs: context // 128)
    c128_width: int = assign_field()


@dataclass
class DSV4Metadata(_Refreshable):
    page_size: int = static_field()
    window: int = static_field()
    c4_sparse_topk: int = static_field()
    # The context length under graphs (the candidate widths in full graphs only), else the
    # batch's longest sequence.
    max_seq_len: int = static_field()
    num_tokens: int = static_field()
    # A decode step outside breakable graphs (eager, or a full decode graph, which replays only
    # decode-shaped steps, idle DP ranks' included): every request feeds one token, so no
    # compressor emission reads a ring row the step writes, and the compressors may write
    # their rings in the pooling launch.
    one_token_per_request: bool = static_field()
    raw_out_loc: torch.Tensor = copy_field()  # [T] raw-KV write row: the token's staging row; -1 for padding rows
    positions: torch.Tensor = copy_field()  # [T]
    # [T] page-table row of each token (padding rows: the padding request); read by the break
    token_rows: torch.Tensor = assign_field()
    attn: DSV4AttnMetadata = copy_field()
    indexer: Optional[DSV4IndexerMetadata] = copy_field(default=None)
    c4_compressor: Optional[DSV4CompressorMetadata] = copy_field(default=None)
    c128_compressor: Optional[DSV4CompressorMetadata] = copy_field(default=None)

    def compressor(self, ratio: int) -> DSV4CompressorMetadata:
        return self.c4_compressor if ratio == 4 else self.c128_compressor

    def page_table_list(self, rtt: torch.Tensor, ratio: int, num_queries: int, padding_slot: int) -> PageTableList:
        """The compressed entries (ratio 4: the indexer's candidates; 128: the attended c128
        entries) of the first `num_queries` tokens, read through the page table `rtt`."""
        width = self.indexer.cand_width if ratio == 4 else self.attn.c128_width
        return PageTableList(rtt, match_num_queries(self.token_rows, num_queries, padding_slot), ratio, width)


def match_num_queries(t: torch.Tensor, num_queries: int, pad_value: int = -1) -> torch.Tensor:
    """Match bucket-sized per-token metadata to the query count: slice, or pad with a
    neutral value (-1 slot / 0 length) when there are more queries than metadata rows."""
    n = t.shape[0]
    if n == num_queries:
        return t
    if n > num_queries:
        return t[:num_queries]
    pad = t.new_full((num_queries - n, *t.shape[1:]), pad_value)
    return torch.cat([t, pad], dim=0)
