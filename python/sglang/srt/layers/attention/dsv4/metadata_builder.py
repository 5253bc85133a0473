"""Builds DSV4Metadata from a ForwardBatch. Runs outside captured segments, before every
replay, so it is on the host's critical path of every step:
- everything that depends on the request lengths is computed from the batch's host lists and
  uploaded in one non-blocking copy (building metadata never waits for the GPU);
- the device side is dsv4_kernels' builder: one launch for the whole step with Triton (every
  per-token field and each ratio's compressor emissions), or the same math as vectorised
  torch (the reference, and the CPU path);
- at replay the copy fields are written straight into the captured storage (`into`), so the
  field-class refresh has nothing left to copy for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional

import numpy as np
import torch
from dsv4_kernels import ops as kernel_ops
from dsv4_kernels import reference as kernel_reference

from sglang.srt.layers.attention.dsv4.metadata import (
    DSV4AttnMetadata,
    DSV4CompressorMetadata,
    DSV4IndexerMetadata,
    DSV4Metadata,
)
from sglang.srt.layers.attention.dsv4.widths import candidate_widths
from sglang.srt.model_executor.host_to_device import to_device_async


@dataclass
class HostLayout:
    """Per-token rows computed on the host (uploaded together): the request's prefix length,
    the batch row of the request's first new token, its new total length, realness; and per
    compression ratio the rows that emit a compressed entry (the first emit_count real)."""

    prefix: torch.Tensor
    chunk_start: torch.Tensor
    seq_len: torch.Tensor
    valid: torch.Tensor
    emit_rows: Dict[int, torch.Tensor]
    emit_count: Dict[int, int]

    @staticmethod
    def from_forward_batch(fb, emissions: Dict[int, Optional[int]]) -> "HostLayout":
        T = fb.num_tokens
        # All in numpy, one torch tensor at the end: torch's CPU ops cost microseconds each
        # (and its repeat_interleave fans out to the OpenMP pool), on the host's critical path
        # of every replay (profile_bcg_step.py).
        ext = np.asarray(fb.extend_seq_lens_cpu, dtype=np.int64)
        n_real = int(ext.sum())
        starts = np.cumsum(ext) - ext
        prefix = np.repeat(np.asarray(fb.extend_prefix_lens_cpu, dtype=np.int64), ext)
        start = np.repeat(starts, ext)
        pos = prefix + np.arange(n_real, dtype=np.int64) - start
        widths, emits, counts = {}, {}, {}
        for ratio in sorted(emissions):
            emits[ratio] = emit = np.flatnonzero((pos + 1) % ratio == 0)
            counts[ratio] = k = emit.size
            widths[ratio] = E = k if emissions[ratio] is None else emissions[ratio]
            if k > E:
                raise ValueError(f"{k} ratio-{ratio} emissions exceed the static bound {E}")
        host = np.zeros(4 * T + sum(widths.values()), dtype=np.int64)
        host[0:n_real] = prefix
        host[T:T + n_real] = start
        host[2 * T:2 * T + n_real] = np.repeat(np.asarray(fb.seq_lens_cpu, dtype=np.int64), ext)
        host[3 * T:3 * T + n_real] = 1
        off = 4 * T
        for ratio in sorted(emissions):  # each ratio's emitting rows, zero-padded to its width
            host[off:off + counts[ratio]] = emits[ratio]
            off += widths[ratio]
        dev = to_device_async(torch.from_numpy(host), fb.device)
        emit_rows, off = {}, 4 * T
        for ratio in sorted(emissions):
            emit_rows[ratio] = dev[off:off + widths[ratio]]
            off += widths[ratio]
        return HostLayout(dev[0:T], dev[T:2 * T], dev[2 * T:3 * T], dev[3 * T:4 * T], emit_rows, counts)


def max_emissions(num_tokens: int, ratio: int, max_num_reqs: int) -> int:
    """Static bound: each request emits at most ceil(new_tokens / ratio) entries."""
    return min(num_tokens, num_tokens // ratio + max_num_reqs)


def build_dsv4_metadata(fb, req_to_token: torch.Tensor, *, padding_slot: int, page_size: int,
                        window: int, index_topk: int, ratios: set, raw_staging_start: int, raw_staging_rows: int,
                        fixed_max_seq_len: Optional[int] = None,
                        max_num_reqs: Optional[int] = None, use_kernels: bool = False,
                        into: Optional[DSV4Metadata] = None, into_all: bool = False,
                        full_graph: bool = False) -> DSV4Metadata:
    """fixed_max_seq_len given (capture / replay): every per-token shape is static (emissions
    padded to their bound). No tensor depends on the sequence lengths: the c4 candidates and
    c128 entries are read through the page table (token_rows + lengths); only the host ints
    cand_width / c128_width do, following the batch's longest sequence, except in a full graph
    (`full_graph`: decode graphs capture the attention core too): fixed_max_seq_len / ratio.
    use_kernels: dsv4_kernels.ops (Triton on CUDA tensors) instead of the torch reference.
    into: a captured metadata of the same shapes whose copy-field tensors (every tensor with
    into_all) are filled in place and returned inside the new object.
    raw_staging_start / raw_staging_rows: where the raw-KV staging rows begin in every layer's
    raw tensor, and how many there are (DSV4KVPool): batch row t stages at start + t, so a
    step carries at most raw_staging_rows tokens."""
    rtt = req_to_token
    T = fb.num_tokens
    if T > raw_staging_rows:
        raise ValueError(f"a step of {T} tokens exceeds the {raw_staging_rows} raw-KV staging rows the pool was "
                         "built with (the most tokens one step carries: ServerArgs.max_step_tokens); raise "
                         "--chunked-prefill-size or split the batch")
    dev = rtt.device
    if fixed_max_seq_len is None:
        max_seq = max(fb.seq_lens_cpu, default=1)
        emissions = {r: None for r in ratios}
    else:
        max_seq = fixed_max_seq_len
        emissions = {r: max_emissions(T, r, max_num_reqs + 1) for r in ratios}
    H = HostLayout.from_forward_batch(fb, emissions)
    impl = kernel_ops if use_kernels else kernel_reference

    def take(captured, shape, dtype, assign=False):
        # copy fields reuse the captured storage; assign fields only when asked (decode graphs)
        if into is not None and captured is not None and (into_all or not assign):
            return captured
        return torch.empty(shape, dtype=dtype, device=dev)

    cap = into
    cap_attn = cap.attn if cap is not None else None
    cap_idx = cap.indexer if cap is not None else None
    i32 = torch.int32
    c4_width, c128_width = candidate_widths(max_seq if full_graph else max(fb.seq_lens_cpu, default=1))
    out = {
        "positions": take(cap and cap.positions, (T,), torch.int64),
        "token_rows": take(cap and cap.token_rows, (T,), i32, assign=True),
        "raw_out_loc": take(cap and cap.raw_out_loc, (T,), i32),
        "window_slots": take(cap_attn and cap_attn.window_slots, (T, window), i32, assign=True),
        "window_len": take(cap_attn and cap_attn.window_len, (T,), i32, assign=True),
        "raw_keep_loc": take(cap_attn and cap_attn.raw_keep_loc, (T,), i32, assign=True),
        "c128_len": take(cap_attn and cap_attn.c128_len, (T,), i32, assign=True),
        "ring128": take(cap and cap.c128_compressor and cap.c128_compressor.ring_write_loc, (T,), i32),
    }
    if 4 in ratios:
        out.update(
            cand_len=take(cap_idx and cap_idx.cand_len, (T,), i32),
            topk_len=take(cap_idx and cap_idx.topk_len, (T,), i32),
            ring4=take(cap and cap.c4_compressor and cap.c4_compressor.ring_write_loc, (T,), i32),
        )
    compressors, emissions = {}, {}
    for r in sorted(ratios):
        c = cap and cap.compressor(r)
        E, R = H.emit_rows[r].shape[0], 2 * r if r == 4 else r
        gather_idx = take(c and c.gather_idx, (E, R), i32)
        out_loc = take(c and c.out_loc, (E,), i32)
        emit_pos = take(c and c.positions, (E,), i32)
        emissions[r] = (H.emit_rows[r], H.emit_count[r], gather_idx, out_loc, emit_pos)
        compressors[r] = DSV4CompressorMetadata(r, gather_idx, out_loc, emit_pos, out[f"ring{r}"])
    # every field of the step in one launch with Triton (the reference: the same math in torch)
    impl.step_metadata(rtt, fb.token_req_slot, fb.positions, H.seq_len, H.valid, H.prefix, H.chunk_start,
                       padding_slot, raw_staging_start, index_topk, out, emissions)

    indexer = None
    if 4 in ratios:
        topk_slots = (cap_idx.topk_slots if cap_idx is not None
                      else torch.full((T, index_topk), -1, dtype=i32, device=dev))
        indexer = DSV4IndexerMetadata(index_topk, c4_width, out["cand_len"], out["topk_len"], topk_slots)
    return DSV4Metadata(
        page_size=page_size,
        window=window,
        c4_sparse_topk=index_topk,
        max_seq_len=max_seq,
        num_tokens=T,
        # a full decode graph replays decode-shaped batches only (under DP an idle rank's too);
        # breakable graphs replay a bucket for any batch layout, so their segments never assume it
        one_token_per_request=full_graph or (fixed_max_seq_len is None and (
            fb.forward_mode.is_decode() or fb.forward_mode.is_idle())),
        raw_out_loc=out["raw_out_loc"],
        positions=out["positions"],
        token_rows=out["token_rows"],
        attn=DSV4AttnMetadata(out["window_slots"], out["window_len"], out["raw_keep_loc"], out["c128_len"],
                              c128_width),
        indexer=indexer,
        c4_compressor=compressors.get(4),
        c128_compressor=compressors.get(128),
    )
