"""Builds DSV4Metadata from a ForwardBatch with a few vectorised launches (no per-request
Python loops on the device side). Runs outside captured segments: host syncs are fine here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from sglang.srt.layers.attention.dsv4.metadata import (
    DSV4AttnMetadata,
    DSV4CompressorMetadata,
    DSV4IndexerMetadata,
    DSV4Metadata,
)


@dataclass
class TokenLayout:
    """Per-token view of a batch: request slot, position, the request's prefix length,
    the batch row of the request's first new token, its new total length, realness."""

    req_slot: torch.Tensor
    pos: torch.Tensor
    prefix: torch.Tensor
    chunk_start: torch.Tensor
    seq_len: torch.Tensor
    valid: torch.Tensor

    @staticmethod
    def from_forward_batch(fb, padding_slot: int) -> "TokenLayout":
        T = fb.num_tokens
        ext = torch.tensor(fb.extend_seq_lens_cpu, dtype=torch.int64)
        n_real = int(ext.sum())
        starts = torch.cumsum(ext, 0) - ext
        host = torch.zeros(4, T, dtype=torch.int64)
        host[0, :n_real] = torch.repeat_interleave(torch.tensor(fb.extend_prefix_lens_cpu, dtype=torch.int64), ext)
        host[1, :n_real] = torch.repeat_interleave(starts, ext)
        host[2, :n_real] = torch.repeat_interleave(torch.tensor(fb.seq_lens_cpu, dtype=torch.int64), ext)
        host[3, :n_real] = 1
        dev = host.to(fb.device, non_blocking=True)
        valid = dev[3].bool()
        req = torch.where(valid, fb.token_req_slot.long(), torch.full_like(fb.token_req_slot.long(), padding_slot))
        pos = torch.where(valid, fb.positions.long(), torch.zeros_like(fb.positions.long()))
        return TokenLayout(req, pos, dev[0], dev[1], dev[2], valid)


def _compressed_lists(rtt: torch.Tensor, L: TokenLayout, ratio: int, width: int):
    i = torch.arange(width, device=rtt.device)
    n = torch.where(L.valid, (L.pos + 1) // ratio, 0)
    cols = (ratio * i + ratio - 1).clamp(max=rtt.shape[1] - 1)
    slots = rtt[L.req_slot[:, None], cols[None, :]].long() // ratio
    return torch.where(i[None, :] < n[:, None], slots, -1).int(), n.int()


def _compressor_metadata(L: TokenLayout, raw_out_loc: torch.Tensor, ratio: int,
                         num_emissions: Optional[int]) -> DSV4CompressorMetadata:
    R = 2 * ratio if ratio == 4 else ratio
    emit = L.valid & ((L.pos + 1) % ratio == 0)
    tok = emit.nonzero().squeeze(1)  # host sync: fine, metadata is built eagerly
    E = tok.numel() if num_emissions is None else num_emissions
    if tok.numel() > E:
        raise ValueError(f"{tok.numel()} ratio-{ratio} emissions exceed the static bound {E}")
    pos, prefix = L.pos[tok], L.prefix[tok]
    entry = (pos + 1) // ratio - 1
    q = ((entry + 1) * ratio - R)[:, None] + torch.arange(R, device=pos.device)[None, :]
    ring = L.req_slot[tok][:, None] * R + q.remainder(R)
    fresh = -(L.chunk_start[tok][:, None] + q - prefix[:, None]) - 2
    idx = torch.where(q < 0, -1, torch.where(q < prefix[:, None], ring, fresh))
    dev = pos.device
    gather_idx = torch.full((E, R), -1, dtype=torch.int32, device=dev)
    out_loc = torch.full((E,), -1, dtype=torch.int32, device=dev)
    positions = torch.zeros(E, dtype=torch.int32, device=dev)
    k = tok.numel()
    gather_idx[:k] = idx.int()
    out_loc[:k] = (raw_out_loc[tok] // ratio).int()
    positions[:k] = (entry * ratio).int()
    keep = L.valid & (L.pos >= L.seq_len - R)
    ring_write_loc = torch.where(keep, L.req_slot * R + L.pos % R, -1).int()
    return DSV4CompressorMetadata(ratio, gather_idx, out_loc, positions, ring_write_loc)


def max_emissions(num_tokens: int, ratio: int, max_num_reqs: int) -> int:
    """Static bound: each request emits at most ceil(new_tokens / ratio) entries."""
    return min(num_tokens, num_tokens // ratio + max_num_reqs)


def build_dsv4_metadata(fb, req_to_token: torch.Tensor, *, padding_slot: int, page_size: int,
                        window: int, index_topk: int, ratios: set,
                        fixed_max_seq_len: Optional[int] = None,
                        max_num_reqs: Optional[int] = None) -> DSV4Metadata:
    """fixed_max_seq_len given (capture / replay): every width is static; else sized to the batch."""
    L = TokenLayout.from_forward_batch(fb, padding_slot)
    rtt = req_to_token
    T = fb.num_tokens
    dev = rtt.device
    if fixed_max_seq_len is None:
        max_seq = max(fb.seq_lens_cpu, default=1)
        emissions = {r: None for r in ratios}
    else:
        max_seq = fixed_max_seq_len
        emissions = {r: max_emissions(T, r, max_num_reqs + 1) for r in ratios}

    raw_out_loc = torch.where(L.valid, rtt[L.req_slot, L.pos.clamp(max=rtt.shape[1] - 1)].long(), -1)

    offs = torch.arange(window, device=dev)
    wlen = torch.where(L.valid, torch.clamp(L.pos + 1, max=window), 0)
    wpos = (L.pos - wlen + 1).clamp(min=0)[:, None] + offs[None, :]
    wslots = rtt[L.req_slot[:, None], wpos.clamp(max=rtt.shape[1] - 1)].long()
    window_slots = torch.where(offs[None, :] < wlen[:, None], wslots, -1).int()

    c128_slots, c128_len = _compressed_lists(rtt, L, 128, max(1, max_seq // 128))
    attn = DSV4AttnMetadata(window_slots, wlen.int(), c128_slots, c128_len)

    indexer = None
    if 4 in ratios:
        cand, cand_len = _compressed_lists(rtt, L, 4, max(1, max_seq // 4))
        indexer = DSV4IndexerMetadata(
            topk=index_topk,
            cand_slots=cand,
            cand_len=cand_len,
            topk_len=torch.clamp(cand_len, max=index_topk),
            topk_slots=torch.full((T, index_topk), -1, dtype=torch.int32, device=dev),
        )
    return DSV4Metadata(
        page_size=page_size,
        window=window,
        c4_sparse_topk=index_topk,
        max_seq_len=max_seq,
        num_tokens=T,
        raw_out_loc=raw_out_loc.int(),
        positions=L.pos,
        attn=attn,
        indexer=indexer,
        c4_compressor=_compressor_metadata(L, raw_out_loc, 4, emissions.get(4)) if 4 in ratios else None,
        c128_compressor=_compressor_metadata(L, raw_out_loc, 128, emissions.get(128)) if 128 in ratios else None,
    )
