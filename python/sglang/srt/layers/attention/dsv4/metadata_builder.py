"""Builds DSV4Metadata from a ForwardBatch with a few vectorised launches (no per-request
Python loops on the device side). Runs outside captured segments, before every replay: it
never waits for the GPU, so the host can prepare the next step while kernels run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import torch

from sglang.srt.layers.attention.dsv4.metadata import (
    DSV4AttnMetadata,
    DSV4CompressorMetadata,
    DSV4IndexerMetadata,
    DSV4Metadata,
)
from sglang.srt.model_executor.host_to_device import to_device_async


@dataclass
class TokenLayout:
    """Per-token view of a batch: request slot, position, the request's prefix length,
    the batch row of the request's first new token, its new total length, realness;
    plus, per compression ratio, the rows that emit a compressed entry this step."""

    req_slot: torch.Tensor
    pos: torch.Tensor
    prefix: torch.Tensor
    chunk_start: torch.Tensor
    seq_len: torch.Tensor
    valid: torch.Tensor
    emit_rows: Dict[int, torch.Tensor]  # ratio -> [E] int64 rows; the first emit_count are real
    emit_count: Dict[int, int]

    @staticmethod
    def from_forward_batch(fb, padding_slot: int, emissions: Dict[int, Optional[int]]) -> "TokenLayout":
        """Everything that depends on the request lengths is computed from the host lists and
        uploaded in one non-blocking copy: building metadata never waits for the GPU."""
        T = fb.num_tokens
        ext = torch.tensor(fb.extend_seq_lens_cpu, dtype=torch.int64)
        n_real = int(ext.sum())
        starts = torch.cumsum(ext, 0) - ext
        prefix = torch.repeat_interleave(torch.tensor(fb.extend_prefix_lens_cpu, dtype=torch.int64), ext)
        start = torch.repeat_interleave(starts, ext)
        pos = prefix + torch.arange(n_real, dtype=torch.int64) - start
        rows, counts, widths = [], {}, {}
        for ratio in sorted(emissions):
            emit = torch.nonzero((pos + 1) % ratio == 0).squeeze(1)
            counts[ratio] = k = emit.numel()
            widths[ratio] = E = k if emissions[ratio] is None else emissions[ratio]
            if k > E:
                raise ValueError(f"{k} ratio-{ratio} emissions exceed the static bound {E}")
            rows.append(torch.cat([emit, emit.new_zeros(E - k)]))
        host = torch.zeros(4 * T + sum(widths.values()), dtype=torch.int64)
        host[0:n_real] = prefix
        host[T:T + n_real] = start
        host[2 * T:2 * T + n_real] = torch.repeat_interleave(torch.tensor(fb.seq_lens_cpu, dtype=torch.int64), ext)
        host[3 * T:3 * T + n_real] = 1
        if rows:
            host[4 * T:] = torch.cat(rows)
        dev = to_device_async(host, fb.device)
        emit_rows, off = {}, 4 * T
        for ratio in sorted(emissions):
            emit_rows[ratio] = dev[off:off + widths[ratio]]
            off += widths[ratio]
        valid = dev[3 * T:4 * T].bool()
        slot = fb.token_req_slot.long()
        req = torch.where(valid, slot, torch.full_like(slot, padding_slot))
        positions = torch.where(valid, fb.positions.long(), 0)
        return TokenLayout(req, positions, dev[0:T], dev[T:2 * T], dev[2 * T:3 * T], valid, emit_rows, counts)


def _compressed_lists(rtt: torch.Tensor, L: TokenLayout, ratio: int, width: int):
    i = torch.arange(width, device=rtt.device)
    n = torch.where(L.valid, (L.pos + 1) // ratio, 0)
    cols = (ratio * i + ratio - 1).clamp(max=rtt.shape[1] - 1)
    slots = rtt[L.req_slot[:, None], cols[None, :]].long() // ratio
    return torch.where(i[None, :] < n[:, None], slots, -1).int(), n.int()


def _compressor_metadata(L: TokenLayout, raw_out_loc: torch.Tensor, ratio: int) -> DSV4CompressorMetadata:
    R = 2 * ratio if ratio == 4 else ratio
    tok = L.emit_rows[ratio]
    real = torch.arange(tok.shape[0], device=tok.device) < L.emit_count[ratio]
    pos, prefix = L.pos[tok], L.prefix[tok]
    entry = (pos + 1) // ratio - 1
    q = ((entry + 1) * ratio - R)[:, None] + torch.arange(R, device=pos.device)[None, :]
    ring = L.req_slot[tok][:, None] * R + q.remainder(R)
    fresh = -(L.chunk_start[tok][:, None] + q - prefix[:, None]) - 2
    idx = torch.where(q < 0, -1, torch.where(q < prefix[:, None], ring, fresh))
    gather_idx = torch.where(real[:, None], idx, -1).int()
    out_loc = torch.where(real, raw_out_loc[tok] // ratio, -1).int()
    positions = torch.where(real, entry * ratio, 0).int()
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
    rtt = req_to_token
    T = fb.num_tokens
    dev = rtt.device
    if fixed_max_seq_len is None:
        max_seq = max(fb.seq_lens_cpu, default=1)
        emissions = {r: None for r in ratios}
    else:
        max_seq = fixed_max_seq_len
        emissions = {r: max_emissions(T, r, max_num_reqs + 1) for r in ratios}
    L = TokenLayout.from_forward_batch(fb, padding_slot, emissions)

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
        c4_compressor=_compressor_metadata(L, raw_out_loc, 4) if 4 in ratios else None,
        c128_compressor=_compressor_metadata(L, raw_out_loc, 128) if 128 in ratios else None,
    )
