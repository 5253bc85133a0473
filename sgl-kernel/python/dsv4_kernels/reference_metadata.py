"""Plain-torch ground truth of the step-metadata builders (metadata.py's kernel, the model's
CPU path): every per-token field of a step's attention metadata and each compressor ratio's
emissions. Re-exported by reference.py, whose contract they are part of."""

import torch


def token_metadata(req_slot, positions, seq_len, valid, prefix, chunk_start, padding_slot: int,
                   staging_start: int, topk: int, out):
    """Every per-token field of one step's attention metadata, written into `out` (a dict):
    positions [T] int64; token_rows [T] (page-table row: the request slot, padding_slot for
    padding rows); when present, c128_len and cand_len / topk_len (compressed entries visible:
    (p+1)//r; their slots are read through the page table, PageTableList), ring128 / ring4 [T]
    (compressor ring row req * R + p % R of the last R tokens of each request, R = 128 / 8, -1
    elsewhere). int32 unless stated. Nothing is wider than the window: no field grows with the
    context length. Rows with valid == 0 are padding: padding request, position 0, nothing to
    read or write.

    Raw (window) KV lives in a per-layer tensor of W ring rows per request slot (row
    req * W + p % W holds position p) followed by staging rows from `staging_start`, one per
    batch row (DSV4KVPool). raw_out_loc [T]: the token's staging row staging_start + t (-1
    padding). window_slots [T, W] (left-aligned, -1 pad) and window_len [T]: the last
    min(p+1, W) positions, a position new in this step (>= its request's `prefix`) read from
    its staging row staging_start + chunk_start + (q - prefix) (chunk_start: the batch row of
    the request's first new token), an older one from the ring. raw_keep_loc [T]: where the
    attention copies the token's staging row once every query has read its window: the ring
    row of one of its request's last W positions (p >= seq_len - W), else its own staging row
    (a no-op copy: no duplicate targets, nothing else touched)."""
    valid = valid.bool()
    req = torch.where(valid, req_slot.long(), padding_slot)
    pos = torch.where(valid, positions.long(), 0)
    pre = torch.where(valid, prefix.long(), 0)
    start = torch.where(valid, chunk_start.long(), 0)
    T = pos.shape[0]
    stage = staging_start + torch.arange(T, device=pos.device)
    out["positions"].copy_(pos)
    out["token_rows"].copy_(req)
    out["raw_out_loc"].copy_(torch.where(valid, stage, -1))
    W = out["window_slots"].shape[1]
    offs = torch.arange(W, device=pos.device)
    wlen = torch.where(valid, torch.clamp(pos + 1, max=W), 0)
    q = (pos - wlen + 1).clamp(min=0)[:, None] + offs[None, :]
    wslots = torch.where(q >= pre[:, None], staging_start + start[:, None] + q - pre[:, None],
                         req[:, None] * W + q % W)
    out["window_slots"].copy_(torch.where(offs[None, :] < wlen[:, None], wslots, -1))
    out["window_len"].copy_(wlen)
    keep = valid & (pos >= seq_len.long() - W)
    out["raw_keep_loc"].copy_(torch.where(keep, req * W + pos % W, stage))
    for ratio, ring, lens in ((128, 128, "c128_len"), (4, 8, "cand_len")):
        if lens not in out:
            continue
        n = torch.where(valid, (pos + 1) // ratio, 0)
        out[lens].copy_(n)
        keep = valid & (pos >= seq_len - ring)
        out[f"ring{ratio}"].copy_(torch.where(keep, req * ring + pos % ring, -1))
        if ratio == 4:
            out["topk_len"].copy_(torch.clamp(n, max=topk))
    return out


def keep_window_rows_(raw, staging_start: int, keep_loc):
    """After attention has read the step's windows: raw[keep_loc[t]] = raw[staging_start + t]
    for the first keep_loc.numel() batch rows (token_metadata's raw_keep_loc), moving each
    request's last W new positions from staging into its ring. Static shapes, no host sync
    (decode graphs capture it). The staging rows are cloned first: source and target share
    one tensor."""
    n = keep_loc.shape[0]
    raw.index_copy_(0, keep_loc.long(), raw[staging_start:staging_start + n].clone())
    return raw


def emission_metadata(rtt, req_slot, positions, valid, prefix, chunk_start, rows, num_real: int,
                      padding_slot: int, ratio: int, gather_idx, out_loc, emit_pos):
    """The compressor's emissions of one step at one ratio (E = rows.numel(), the first
    num_real real): gather_idx [E, R] source rows of each emitted entry (>= 0 ring-state row
    req * R + q % R for cached positions q < prefix, <= -2 fresh token -(batch row)-2, -1
    before position 0), out_loc [E] its compressed-pool slot, emit_pos [E] its RoPE position.
    Per token: prefix = its request's cached length, chunk_start = batch row of the request's
    first new token. Padding emissions get -1 / -1 / 0."""
    E, R = gather_idx.shape
    tok = rows.long()
    v = valid[tok].bool()
    slot = torch.where(v, req_slot[tok].long(), padding_slot)
    pos = torch.where(v, positions[tok].long(), 0)
    pre, start = prefix[tok].long(), chunk_start[tok].long()
    real = torch.arange(E, device=tok.device) < num_real
    entry = (pos + 1) // ratio - 1
    q = ((entry + 1) * ratio - R)[:, None] + torch.arange(R, device=tok.device)[None, :]
    ring = slot[:, None] * R + q.remainder(R)
    fresh = -(start[:, None] + q - pre[:, None]) - 2
    idx = torch.where(q < 0, -1, torch.where(q < pre[:, None], ring, fresh))
    gather_idx.copy_(torch.where(real[:, None], idx, -1))
    raw = rtt[slot, pos.clamp(max=rtt.shape[1] - 1)].long()
    out_loc.copy_(torch.where(real, raw // ratio, -1))
    emit_pos.copy_(torch.where(real, entry * ratio, 0))


def step_metadata(rtt, req_slot, positions, seq_len, valid, prefix, chunk_start, padding_slot: int,
                  staging_start: int, topk: int, out, emissions):
    """token_metadata into `out`, then emission_metadata of each ratio in `emissions`
    ({ratio: (rows, num_real, gather_idx, out_loc, emit_pos)}): one step's whole metadata."""
    token_metadata(req_slot, positions, seq_len, valid, prefix, chunk_start, padding_slot, staging_start, topk, out)
    for ratio in sorted(emissions):
        rows, num_real, gather_idx, out_loc, emit_pos = emissions[ratio]
        emission_metadata(rtt, req_slot, positions, valid, prefix, chunk_start, rows, num_real, padding_slot,
                          ratio, gather_idx, out_loc, emit_pos)
    return out
