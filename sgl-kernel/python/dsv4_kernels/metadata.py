"""Triton builder of the per-step DSV4 attention metadata: one launch for a whole step, every
per-token field and the compressor emissions of each ratio (programs [0, T) are tokens, the
rest emissions). No per-token list of compressed entries is built: consumers read them
through the page table (PageTableList).

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
def _token_row(
    t, req_ptr, pos_ptr, seq_len_ptr, valid_ptr, prefix_ptr, start_ptr, padding_slot, staging_start,
    pos_out, rows_out, raw_out, win_ptr, win_len_ptr, keep_ptr, W,
    c128_len_ptr, ring128_ptr, cand_len_ptr, topk_len_ptr, topk, ring4_ptr,
    HAS_C4: tl.constexpr, HAS_C128: tl.constexpr, BLOCK: tl.constexpr,
):
    """Every per-token field of token t (reference.token_metadata)."""
    valid = tl.load(valid_ptr + t) != 0
    slot = tl.where(valid, tl.load(req_ptr + t), padding_slot).to(tl.int64)
    pos = tl.where(valid, tl.load(pos_ptr + t), 0).to(tl.int64)
    prefix = tl.where(valid, tl.load(prefix_ptr + t), 0).to(tl.int64)
    start = tl.where(valid, tl.load(start_ptr + t), 0).to(tl.int64)
    seq_len = tl.load(seq_len_ptr + t)
    stage = staging_start + t
    tl.store(pos_out + t, pos)
    tl.store(rows_out + t, slot.to(tl.int32))
    tl.store(raw_out + t, tl.where(valid, stage, -1).to(tl.int32))

    wlen = tl.where(valid, tl.minimum(pos + 1, W), 0)
    wstart = tl.maximum(pos - wlen + 1, 0)
    for c0 in range(0, W, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        live = cols < wlen
        q = wstart + cols
        # this step's positions from their staging rows, older ones from the request's ring
        s = tl.where(q >= prefix, staging_start + start + q - prefix, slot * W + q % W)
        tl.store(win_ptr + t * W + cols, tl.where(live, s, -1).to(tl.int32), mask=cols < W)
    tl.store(win_len_ptr + t, wlen.to(tl.int32))
    keep = valid & (pos >= seq_len - W)
    tl.store(keep_ptr + t, tl.where(keep, slot * W + pos % W, stage).to(tl.int32))

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
def _emission_row(
    e, rtt_ptr, stride_rtt, max_col, req_ptr, pos_ptr, valid_ptr, prefix_ptr, start_ptr, rows_ptr,
    num_real, padding_slot, gather_ptr, out_loc_ptr, epos_ptr,
    RATIO: tl.constexpr, R: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """Emission e of one ratio (reference.emission_metadata)."""
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


@triton.jit
def _step_metadata_kernel(
    rtt_ptr, stride_rtt, max_col, req_ptr, pos_ptr, seq_len_ptr, valid_ptr, prefix_ptr, start_ptr,
    padding_slot, staging_start, T,
    pos_out, rows_out, raw_out, win_ptr, win_len_ptr, keep_ptr, W,
    c128_len_ptr, ring128_ptr, cand_len_ptr, topk_len_ptr, topk, ring4_ptr,
    rows4_ptr, num_real4, gather4_ptr, out_loc4_ptr, epos4_ptr, E4,
    rows128_ptr, num_real128, gather128_ptr, out_loc128_ptr, epos128_ptr,
    HAS_C4: tl.constexpr, HAS_C128: tl.constexpr, HAS_E4: tl.constexpr, HAS_E128: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Programs [0, T): tokens; [T, T + E4): ratio-4 emissions; then ratio-128 emissions."""
    p = tl.program_id(0)
    if p < T:
        _token_row(p.to(tl.int64), req_ptr, pos_ptr, seq_len_ptr, valid_ptr, prefix_ptr, start_ptr,
                   padding_slot, staging_start, pos_out, rows_out, raw_out, win_ptr, win_len_ptr, keep_ptr, W,
                   c128_len_ptr, ring128_ptr, cand_len_ptr, topk_len_ptr, topk, ring4_ptr,
                   HAS_C4, HAS_C128, BLOCK)
    elif p < T + E4:
        if HAS_E4:
            _emission_row(p - T, rtt_ptr, stride_rtt, max_col, req_ptr, pos_ptr, valid_ptr, prefix_ptr, start_ptr,
                          rows4_ptr, num_real4, padding_slot, gather4_ptr, out_loc4_ptr, epos4_ptr,
                          4, 8, 8)
    else:
        if HAS_E128:
            _emission_row(p - T - E4, rtt_ptr, stride_rtt, max_col, req_ptr, pos_ptr, valid_ptr, prefix_ptr,
                          start_ptr, rows128_ptr, num_real128, padding_slot, gather128_ptr, out_loc128_ptr,
                          epos128_ptr, 128, 128, 128)


# The compressors' ring sizes per ratio (R rows of state per request), as the kernel hard-codes.
EMISSION_RING = {4: 8, 128: 128}


def step_metadata(rtt, req_slot, positions, seq_len, valid, prefix, chunk_start, padding_slot, staging_start, topk,
                  out, emissions):
    """token_metadata, then emission_metadata of every ratio in `emissions` ({ratio: (rows,
    num_real, gather_idx, out_loc, emit_pos)}), in one launch. See the reference's two. The
    token programs are out["positions"]'s rows (none when it is empty)."""
    T = out["positions"].shape[0]
    for ratio, em in emissions.items():
        if ratio not in EMISSION_RING or em[2].shape[1] != EMISSION_RING[ratio]:
            raise ValueError(f"ratio {ratio}: the kernel handles ratios 4 and 128 with rings of 8 and 128 rows")
    E4 = emissions[4][0].shape[0] if 4 in emissions else 0
    E128 = emissions[128][0].shape[0] if 128 in emissions else 0
    if T + E4 + E128 == 0:
        return out
    dummy = out["window_len"]
    e4 = emissions.get(4, (dummy, 0, dummy, dummy, dummy))
    e128 = emissions.get(128, (dummy, 0, dummy, dummy, dummy))
    _step_metadata_kernel[(T + E4 + E128,)](
        rtt, rtt.stride(0), rtt.shape[1] - 1, req_slot, positions, seq_len, valid, prefix, chunk_start,
        padding_slot, staging_start, T,
        out["positions"], out["token_rows"], out["raw_out_loc"], out["window_slots"], out["window_len"],
        out["raw_keep_loc"], out["window_slots"].shape[1],
        out.get("c128_len", dummy), out.get("ring128", dummy),
        out.get("cand_len", dummy), out.get("topk_len", dummy), topk, out.get("ring4", dummy),
        e4[0], e4[1], e4[2], e4[3], e4[4], E4,
        e128[0], e128[1], e128[2], e128[3], e128[4],
        HAS_C4="cand_len" in out, HAS_C128="c128_len" in out, HAS_E4=E4 > 0, HAS_E128=E128 > 0,
        BLOCK=BLOCK, num_warps=4,
    )
    return out


def token_metadata(req_slot, positions, seq_len, valid, prefix, chunk_start, padding_slot, staging_start, topk, out):
    """See reference.token_metadata (the step kernel's token programs only; the page table is
    read by emissions alone, so a stand-in fills its argument)."""
    return step_metadata(req_slot.view(1, -1), req_slot, positions, seq_len, valid, prefix, chunk_start, padding_slot,
                         staging_start, topk, out, {})


def emission_metadata(rtt, req_slot, positions, valid, prefix, chunk_start, rows, num_real,
                      padding_slot, ratio, gather_idx, out_loc, emit_pos):
    """See reference.emission_metadata (the step kernel's programs of one ratio only)."""
    if rows.shape[0] == 0:
        return
    empty = positions[:0]
    out = {"positions": empty, "token_rows": empty, "raw_out_loc": empty, "window_slots": gather_idx[:0],
           "window_len": out_loc, "raw_keep_loc": out_loc}  # no token programs run; these only fill the signature
    step_metadata(rtt, req_slot, positions, positions, valid, prefix, chunk_start, padding_slot, 0, 0, out,
                  {ratio: (rows, num_real, gather_idx, out_loc, emit_pos)})
