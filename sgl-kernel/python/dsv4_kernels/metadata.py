"""Triton builders of the per-step DSV4 attention metadata: one launch for every per-token
field, one per compression ratio for the compressor emissions. No per-token list of
compressed entries is built: consumers read them through the page table (PageTableList).

The torch version of the same builder (reference.token_metadata / emission_metadata) is
~100 small launches; under breakable graphs it runs on the host before every replay, so
its launch cost is paid on every extend/mixed step. Outputs are written into the caller's
tensors (the captured metadata's own storage at replay). Integer math only: the results are
identical to the reference.
"""

import triton
import triton.language as tl

BLOCK = 128


@triton.jit
def _token_metadata_kernel(
    rtt_ptr, stride_rtt, max_col, req_ptr, pos_ptr, seq_len_ptr, valid_ptr, padding_slot,
    pos_out, rows_out, raw_out, win_ptr, win_len_ptr, W,
    c128_len_ptr, ring128_ptr, cand_len_ptr, topk_len_ptr, topk, ring4_ptr,
    HAS_C4: tl.constexpr, HAS_C128: tl.constexpr, BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    valid = tl.load(valid_ptr + t) != 0
    slot = tl.where(valid, tl.load(req_ptr + t), padding_slot).to(tl.int64)
    pos = tl.where(valid, tl.load(pos_ptr + t), 0).to(tl.int64)
    seq_len = tl.load(seq_len_ptr + t)
    row = rtt_ptr + slot * stride_rtt
    tl.store(pos_out + t, pos)
    tl.store(rows_out + t, slot.to(tl.int32))
    raw = tl.load(row + tl.minimum(pos, max_col))
    tl.store(raw_out + t, tl.where(valid, raw, -1).to(tl.int32))

    wlen = tl.where(valid, tl.minimum(pos + 1, W), 0)
    wstart = tl.maximum(pos - wlen + 1, 0)
    for c0 in range(0, W, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        live = cols < wlen
        s = tl.load(row + tl.minimum(wstart + cols, max_col), mask=live, other=0)
        tl.store(win_ptr + t * W + cols, tl.where(live, s, -1).to(tl.int32), mask=cols < W)
    tl.store(win_len_ptr + t, wlen.to(tl.int32))

    if HAS_C128:
        n = tl.where(valid, (pos + 1) // 128, 0)
        tl.store(c128_len_ptr + t, n.to(tl.int32))
        keep = valid & (pos >= seq_len - 128)
        tl.store(ring128_ptr + t, tl.where(keep, slot * 128 + pos % 128, -1).to(tl.int32))
    if HAS_C4:
        n = tl.where(valid, (pos + 1) // 4, 0)
        tl.store(cand_len_ptr + t, n.to(tl.int32))
        tl.store(topk_len_ptr + t, tl.minimum(n, topk).to(tl.int32))
        keep = valid & (pos >= seq_len - 8)
        tl.store(ring4_ptr + t, tl.where(keep, slot * 8 + pos % 8, -1).to(tl.int32))


@triton.jit
def _emission_metadata_kernel(
    rtt_ptr, stride_rtt, max_col, req_ptr, pos_ptr, valid_ptr, prefix_ptr, start_ptr, rows_ptr,
    num_real, padding_slot, gather_ptr, out_loc_ptr, epos_ptr,
    RATIO: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr,
):
    e = tl.program_id(0)
    real = e < num_real
    tok = tl.load(rows_ptr + e)
    valid = tl.load(valid_ptr + tok) != 0
    slot = tl.where(valid, tl.load(req_ptr + tok), padding_slot).to(tl.int64)
    pos = tl.where(valid, tl.load(pos_ptr + tok), 0).to(tl.int64)
    prefix = tl.load(prefix_ptr + tok)
    start = tl.load(start_ptr + tok)
    entry = (pos + 1) // RATIO - 1
    j = tl.arange(0, BLOCK_R)
    q = (entry + 1) * RATIO - R + j
    # q % R is only used where 0 <= q (ring rows of cached positions), so C's remainder is fine.
    ring = slot * R + q % R
    fresh = -(start + q - prefix) - 2
    idx = tl.where(q < 0, -1, tl.where(q < prefix, ring, fresh))
    tl.store(gather_ptr + e * R + j, tl.where(real, idx, -1).to(tl.int32), mask=j < R)
    raw = tl.load(rtt_ptr + slot * stride_rtt + tl.minimum(pos, max_col))
    tl.store(out_loc_ptr + e, tl.where(real, raw // RATIO, -1).to(tl.int32))
    tl.store(epos_ptr + e, tl.where(real, entry * RATIO, 0).to(tl.int32))


def token_metadata(rtt, req_slot, positions, seq_len, valid, padding_slot, topk, out):
    """See reference.token_metadata."""
    T = positions.shape[0]
    if T == 0:
        return out
    has_c4, has_c128 = "cand_len" in out, "c128_len" in out
    dummy = out["window_len"]
    W = out["window_slots"].shape[1]
    _token_metadata_kernel[(T,)](
        rtt, rtt.stride(0), rtt.shape[1] - 1, req_slot, positions, seq_len, valid, padding_slot,
        out["positions"], out["token_rows"], out["raw_out_loc"], out["window_slots"], out["window_len"], W,
        out.get("c128_len", dummy), out.get("ring128", dummy),
        out.get("cand_len", dummy), out.get("topk_len", dummy), topk, out.get("ring4", dummy),
        HAS_C4=has_c4, HAS_C128=has_c128, BLOCK=BLOCK, num_warps=4,
    )
    return out


def emission_metadata(rtt, req_slot, positions, valid, prefix, chunk_start, rows, num_real,
                      padding_slot, ratio, gather_idx, out_loc, emit_pos):
    """See reference.emission_metadata."""
    E, R = gather_idx.shape
    if E == 0:
        return
    _emission_metadata_kernel[(E,)](
        rtt, rtt.stride(0), rtt.shape[1] - 1, req_slot, positions, valid, prefix, chunk_start, rows,
        num_real, padding_slot, gather_idx, out_loc, emit_pos,
        RATIO=ratio, R=R, BLOCK_R=triton.next_power_of_2(R), num_warps=4,
    )
