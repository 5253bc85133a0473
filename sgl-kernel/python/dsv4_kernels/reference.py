"""Plain-torch ground truth for every DSV4 kernel (CPU and CUDA).

Readable and vectorised over tokens; the Triton kernels are tested against these. Maths is
fp32 throughout; results are cast to the output buffer's dtype at the end. Everything that the
model runs inside a graph segment (all but sparse attention) keeps static shapes and never syncs,
so it also replays correctly under the CPU graph emulator.
"""

from typing import Optional, Tuple

import torch

from .index_key_fp4 import IndexKeyFP4Layout
from .kv_fp8 import FP8KVLayout, round_nope_fp8
from .page_table_list import PageTableList, list_width
from .reference_metadata import emission_metadata, keep_window_rows_, step_metadata, token_metadata  # noqa: F401

# ----------------------------------------------------------------------------------------
# Deterministic top-k
# ----------------------------------------------------------------------------------------


def topk_indices(score: torch.Tensor, k: int) -> torch.Tensor:
    """Columns of the k largest fp32 `score`s per row: by score descending, exact ties by
    column ascending, on every device and for any row width (torch.topk breaks ties in a
    device- and width-dependent order). One top-k over a strictly ordered int64 key (the
    score's order-preserving bits, then the reversed column): static shapes, no host sync,
    graph-safe. -inf ranks below every finite score; -0.0 counts as +0.0."""
    C = score.shape[-1]
    bits = (score.float() + 0.0).view(torch.int32)  # + 0.0: -0.0 becomes +0.0
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)  # int order == float order
    col = torch.arange(C, device=score.device, dtype=torch.int64)
    key = ordered * (1 << 32) + (C - 1 - col)
    return key.topk(k, dim=-1).indices


def bf16_gemv(x, weight, scale: float = 1.0, round_bf16: bool = False):
    """ops.bf16_gemv: [x] * R along K (R = weight columns / K) @ weight^T, fp32 products and
    sums, optionally rounded to bf16, times scale."""
    repeat = weight.shape[1] // x.shape[-1]
    xr = torch.cat([x] * repeat, dim=-1) if repeat > 1 else x
    out = xr.float() @ weight.float().t()
    if round_bf16:
        out = out.to(torch.bfloat16).float()
    return out * scale


# ----------------------------------------------------------------------------------------
# Sparse attention with a per-head sink
# ----------------------------------------------------------------------------------------


def index_list(idx, length) -> torch.Tensor:
    """An index list as a [T, W] tensor: as given, or a PageTableList gathered (only ever for
    the bounded chunk of tokens a caller works on)."""
    return idx.gather(length) if isinstance(idx, PageTableList) else idx


def _gather_keys(kv, idx, length, kv_layout=None):
    """Rows of kv for each token's index list (a [T, W] tensor or a PageTableList), and which
    of them count ([T, W, D], [T, W]). With kv_layout, kv holds FP8 KV rows (kv_fp8.py),
    dequantized as they are gathered."""
    idx = index_list(idx, length)
    cols = torch.arange(idx.shape[1], device=idx.device)
    valid = (cols[None, :] < length[:, None].long()) & (idx >= 0)
    if kv_layout is not None:
        return kv_layout.unpack(kv[idx.long().clamp(min=0)]), valid
    rows = kv[idx.long().clamp(min=0)].float()  # gather, then widen: never a copy of the whole pool
    return rows, valid


def check_kv_layout(kv, kv_layout, what: str) -> None:
    """An FP8 row pool needs its layout and a float pool must not get one (clear errors)."""
    if kv_layout is None:
        if kv.dtype == torch.uint8:
            raise ValueError(f"{what}: uint8 KV rows need kv_layout (an FP8KVLayout)")
    else:
        kv_layout.check_rows(kv, what)


# Working set of one token chunk of the reference attention (gathered fp32 rows, scores):
# bounds it at long context, where a token's c128 list alone is context / 128 entries.
ATTN_REFERENCE_WORKSPACE_BYTES = 256 * 1024 * 1024


def sparse_attn_with_sink(q, kv_a, idx_a, len_a, kv_b, idx_b, len_b, sink, scale, out,
                          token_chunk: Optional[int] = None, kv_layout=None, out_rope=None, keep_rows=None):
    """out[t,h] = softmax over the union of valid a- and b-entries, the sink only in the
    denominator. idx_a / idx_b: [T, W] slot lists or PageTableLists (gathered per chunk).
    Tokens are processed in chunks so the gathered rows stay small: `token_chunk`, by default
    64 or fewer, as ATTN_REFERENCE_WORKSPACE_BYTES allows at the lists' widths. kv_layout
    (kv_fp8.FP8KVLayout): kv_a / kv_b are FP8 KV rows, read dequantized. out_rope (cos, sin,
    positions, rope_dim): then inverse_rope_ on out (its first T positions); keep_rows
    (staging_start, keep_loc): then keep_window_rows_ on kv_a."""
    check_kv_layout(kv_a, kv_layout, "sparse_attn_with_sink kv_a")
    if kv_b is not None:
        check_kv_layout(kv_b, kv_layout, "sparse_attn_with_sink kv_b")
    T, H, D = q.shape
    if token_chunk is None:
        width = list_width(idx_a) + (list_width(idx_b) if kv_b is not None else 0)
        # per token and entry: the gathered row and its concatenated copy (fp32), and the
        # scores, masked scores and probabilities of every head
        token_chunk = max(1, min(64, ATTN_REFERENCE_WORKSPACE_BYTES // max(1, width * (8 * D + 12 * H))))
    sink = sink.float()
    for start in range(0, T, token_chunk):
        sl = slice(start, min(start + token_chunk, T))
        keys, valid = _gather_keys(kv_a, idx_a[sl], len_a[sl], kv_layout)
        if kv_b is not None:
            keys_b, valid_b = _gather_keys(kv_b, idx_b[sl], len_b[sl], kv_layout)
            keys = torch.cat([keys, keys_b], dim=1)
            valid = torch.cat([valid, valid_b], dim=1)
        scores = torch.einsum("thd,tjd->thj", q[sl].float(), keys) * scale
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        # The sink is one more logit that takes probability mass but has no value row.
        sink_col = sink[None, :, None].expand(scores.shape[0], -1, 1)
        probs = torch.softmax(torch.cat([scores, sink_col], dim=-1), dim=-1)[..., :-1]
        out[sl] = torch.einsum("thj,tjd->thd", probs, keys).to(out.dtype)
    if out_rope is not None:
        cos, sin, positions, rope_dim = out_rope
        inverse_rope_(out, cos, sin, positions[:T], rope_dim)
    if keep_rows is not None:
        keep_window_rows_(kv_a, *keep_rows)
    return out


# ----------------------------------------------------------------------------------------
# RMSNorm / interleaved RoPE / fused cache write
# ----------------------------------------------------------------------------------------


def rms_norm(x, weight: Optional[torch.Tensor], eps: float):
    x = x.float()
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y * weight.float() if weight is not None else y


def apply_rope(x, cos, sin, positions, rope_dim: int, inverse: bool = False):
    """GPT-J (interleaved) RoPE on the last rope_dim dims of x [T, ..., D], fp32 result.
    cos/sin: [max_pos, rope_dim // 2]; inverse rotates by -angle."""
    x = x.float().clone()
    c = cos.float()[positions.long()]
    s = sin.float()[positions.long()]
    if inverse:
        s = -s
    # Broadcast [T, rope_dim/2] over any middle (head) dims.
    for _ in range(x.dim() - 2):
        c, s = c.unsqueeze(1), s.unsqueeze(1)
    rot = x[..., x.shape[-1] - rope_dim:]
    even, odd = rot[..., 0::2].clone(), rot[..., 1::2].clone()
    rot[..., 0::2] = even * c - odd * s
    rot[..., 1::2] = even * s + odd * c
    return x


def scatter_rows_(dst, loc, rows, keep=None):
    """dst[loc[t]] = rows[t] where keep[t] (default loc >= 0), with static shapes: a skipped
    token rewrites the first kept token's row with that same value (or, if none is kept, row 0
    with its own content), so duplicate indices always carry identical values."""
    if loc.numel() == 0:
        return
    keep = loc >= 0 if keep is None else keep
    loc = loc.long()
    rows = rows.to(dst.dtype)
    # index_select with a 1-element index, not loc[first]: indexing with a 0-d tensor reads
    # it back to the host (.item()), which a captured graph segment cannot do.
    first = keep.int().argmax().view(1)  # 0 when nothing is kept
    any_kept = keep.any()
    fallback_loc = torch.where(any_kept, loc.index_select(0, first).clamp(min=0), 0)
    fallback_row = torch.where(any_kept, rows.index_select(0, first)[0], dst[0])
    target = torch.where(keep, loc, fallback_loc)
    values = torch.where(keep[:, None], rows.reshape(rows.shape[0], -1),
                         fallback_row.reshape(1, -1))
    dst.index_copy_(0, target, values.view((-1,) + tuple(dst.shape[1:])))


def kv_cache_rows(y, pool, rope_dim: int, nope_fp8: bool):
    """Rows y [T, D] as `pool` stores them: packed FP8 rows for a uint8 pool
    (kv_fp8.FP8KVLayout.of_rows), the nope dims FP8-rounded per 64 for a float pool with
    nope_fp8, else y itself."""
    if pool.dtype == torch.uint8:
        return FP8KVLayout.of_rows(pool, y.shape[-1], rope_dim).pack(y)
    return round_nope_fp8(y, rope_dim) if nope_fp8 else y


def rmsnorm_rope_store(kv, norm_weight, eps, cos, sin, positions, rope_dim, pool, out_loc,
                       kv_out=None, nope_fp8: bool = False):
    """pool[out_loc[t]] = RoPE(RMSNorm(kv[t]) * weight), in the pool's format (kv_cache_rows:
    nope_fp8 rounds a float pool's nope dims; a uint8 pool holds FP8 rows). kv_out gets the
    unrounded rows."""
    y = apply_rope(rms_norm(kv, norm_weight, eps), cos, sin, positions, rope_dim)
    if pool is not None:
        scatter_rows_(pool, out_loc, kv_cache_rows(y, pool, rope_dim, nope_fp8))
    if kv_out is not None:
        kv_out.copy_(y.to(kv_out.dtype))
    return kv_out


def q_rms_rope(q, cos, sin, positions, rope_dim, eps):
    q.copy_(apply_rope(rms_norm(q, None, eps), cos, sin, positions, rope_dim).to(q.dtype))
    return q


def q_kv_norm_rope_store(q, kv, norm_weight, eps, cos, sin, positions, rope_dim, pool, out_loc, nope_fp8=False):
    q_rms_rope(q, cos, sin, positions, rope_dim, eps)
    rmsnorm_rope_store(kv, norm_weight, eps, cos, sin, positions, rope_dim, pool, out_loc, nope_fp8=nope_fp8)
    return q


def inverse_rope_(o, cos, sin, positions, rope_dim):
    o.copy_(apply_rope(o, cos, sin, positions, rope_dim, inverse=True).to(o.dtype))
    return o


# ----------------------------------------------------------------------------------------
# Compressor
# ----------------------------------------------------------------------------------------


def _gather_compressor_rows(state, new, gather_idx):
    """Rows named by gather_idx: >= 0 state row, <= -2 fresh row (-idx-2), -1 empty."""
    flat_state = state.reshape(-1, state.shape[-1]).float()
    idx = gather_idx.long()
    from_state = flat_state[idx.clamp(min=0)]
    from_new = new.float()[(-idx - 2).clamp(min=0)]
    rows = torch.where((idx >= 0)[..., None], from_state, from_new)
    return rows, idx == -1


def with_ape(score_new, ape, positions):
    """The fresh scores plus their positions' ape rows (none: as they are)."""
    return score_new if ape is None else score_new + ape[positions[:score_new.shape[0]].long() % ape.shape[0]]


def compressor_pool(kv_state, score_state, kv_new, score_new, gather_idx, ratio, out, ape=None, positions=None):
    """pooled [E, D] = per-channel softmax(score) weighted sum of kv over each emission's rows.
    ape [ratio, C] with positions [T]: fresh score rows get ape[position % ratio] first."""
    score_new = with_ape(score_new, ape, positions)
    kv, empty = _gather_compressor_rows(kv_state, kv_new, gather_idx)
    score, _ = _gather_compressor_rows(score_state, score_new, gather_idx)
    kv = kv.masked_fill(empty[..., None], 0.0)
    score = score.masked_fill(empty[..., None], float("-inf"))
    if ratio == 4:
        # Overlap: the first r rows (block i-1) use channel half [0:D], the last r rows
        # (block i) half [D:2D]; one softmax over all 2r values of a channel.
        D = kv.shape[-1] // 2
        kv = torch.cat([kv[:, :ratio, :D], kv[:, ratio:, D:]], dim=1)
        score = torch.cat([score[:, :ratio, :D], score[:, ratio:, D:]], dim=1)
    # An emission whose rows are all empty (padding) pools to zero instead of NaN.
    all_empty = torch.isinf(score).all(dim=1, keepdim=True)
    weights = torch.softmax(score.masked_fill(all_empty, 0.0), dim=1)
    out.copy_((weights * kv).sum(dim=1))
    return out


def compressor_plan(token_req_slot, positions, ratio: int):
    """Static-shape compressor metadata of one forward, one row per token (CUDA-graph friendly):

    gather_idx [T, R] int32: for a token that emits (p+1) % ratio == 0, the rows of its entry in
    compressor_pool's encoding (a position also in this forward -> -(t')-2 with t' its token
    index; an older one -> its ring row req*R + q%R; block -1 -> -1); all -1 for other tokens,
    which then pool to zeros and must have emit_out_loc -1.
    emit_pos [T]: the entry's RoPE position i*ratio (0 where nothing is emitted).
    ring_write_loc [T] int32: req*R + p%R, -1 for padding tokens (token_req_slot < 0).

    Assumes a request's tokens in the forward are contiguous with consecutive positions."""
    coff = 2 if ratio == 4 else 1
    R = coff * ratio
    req = token_req_slot.long()
    p = positions.long()
    T = p.shape[0]
    real = req >= 0
    emits = real & ((p + 1) % ratio == 0)
    entry = torch.div(p + 1, ratio, rounding_mode="floor") - 1
    # Column j holds position first + j: block i-1 then block i for ratio 4, block i for 128.
    first = (entry - (coff - 1)) * ratio
    q = first[:, None] + torch.arange(R, device=p.device)[None, :]
    token_of_q = torch.arange(T, device=p.device)[:, None] - (p[:, None] - q)
    safe = token_of_q.clamp(0, max(T - 1, 0))
    fresh = (token_of_q >= 0) & (req[safe] == req[:, None]) & (p[safe] == q)
    idx = torch.where(fresh, -token_of_q - 2, req[:, None] * R + q % R)
    idx = torch.where((q >= 0) & emits[:, None], idx, -1)
    emit_pos = torch.where(emits, entry * ratio, 0)
    ring_write_loc = torch.where(real, req * R + p % R, -1)
    return idx.to(torch.int32), emit_pos, ring_write_loc.to(torch.int32)


def compressor_norm_rope_store(pooled, norm_weight, eps, cos, sin, emit_pos, rope_dim, pool,
                               emit_out_loc):
    rmsnorm_rope_store(pooled, norm_weight, eps, cos, sin, emit_pos, rope_dim, pool, emit_out_loc)


def ring_write_winners(ring_write_loc, num_rows: int):
    """True for the token that owns its ring row: the last token of the forward that writes
    it (a long chunk wraps the ring and only the newest position may stay)."""
    T = ring_write_loc.shape[0]
    loc = ring_write_loc.long()
    keep = loc >= 0
    order = torch.arange(T, device=loc.device)
    winner = torch.full((num_rows + 1,), -1, dtype=torch.long, device=loc.device)
    # Padding tokens scatter into the extra last row, which nobody reads.
    winner.scatter_reduce_(0, torch.where(keep, loc, num_rows), order, "amax")
    return keep & (winner[loc.clamp(min=0)] == order)


def compressor_state_update(kv_state, score_state, kv_new, score_new, ring_write_loc, rows_unique=False,
                            ape=None, positions=None):
    score_new = with_ape(score_new, ape, positions)
    flat_kv = kv_state.view(-1, kv_state.shape[-1])
    flat_score = score_state.view(-1, score_state.shape[-1])
    # rows_unique only lets the kernel skip the search; the reference always applies the rule
    keep = ring_write_winners(ring_write_loc, flat_kv.shape[0])
    scatter_rows_(flat_kv, ring_write_loc, kv_new, keep)
    scatter_rows_(flat_score, ring_write_loc, score_new, keep)


# ----------------------------------------------------------------------------------------
# Indexer
# ----------------------------------------------------------------------------------------


def index_key_layout(key_pool, dim: int) -> Optional[IndexKeyFP4Layout]:
    """The packed FP4 layout of a uint8 indexer-key pool (index_key_fp4.py), None for a float one."""
    return IndexKeyFP4Layout.of_rows(key_pool, dim) if key_pool.dtype == torch.uint8 else None


def store_index_keys_fp4(keys, key_pool, out_loc):
    """key_pool[out_loc[e]] <- keys [E, D] Hadamard-rotated (in keys' dtype), FP4-rounded per 32
    and packed (index_key_fp4.py: the values fp4_round_blocks gives); out_loc -1 skipped."""
    from .quant_reference import hadamard_rotate

    layout = IndexKeyFP4Layout.of_rows(key_pool, keys.shape[-1])
    scatter_rows_(key_pool, out_loc, layout.pack(hadamard_rotate(keys)))
    return key_pool


def indexer_logits(q_idx, weights, key_pool, cand_slots, cand_len):
    """I(t, j) [T, C] fp32; -inf where j >= cand_len[t] or the slot is -1. cand_slots: [T, C]
    slots, or a PageTableList of width C (its lists are gathered here: callers bound T).
    key_pool: keys in a float dtype, or uint8 packed FP4 keys (unpacked as they are gathered:
    the same fp32 values, so the same logits as float keys holding them)."""
    keys, valid = _gather_keys(key_pool, cand_slots, cand_len, index_key_layout(key_pool, q_idx.shape[-1]))
    dots = torch.einsum("thd,tjd->thj", q_idx.float(), keys).relu_()  # in place: the model's hot path
    logits = torch.einsum("th,thj->tj", weights.float(), dots)
    return logits.masked_fill_(~valid, float("-inf"))


def select_topk_slots(logits, cand_slots, topk, out_slots):
    """out_slots [T, topk] = slots of the best min(topk, valid) logits, -1 for the rest.
    cand_slots: [T, C] slots, or a PageTableList (only the chosen columns are read)."""
    k = min(topk, logits.shape[1])
    cols = topk_indices(logits, k)
    values = torch.gather(logits, 1, cols)
    if isinstance(cand_slots, PageTableList):
        chosen = cand_slots.slots_at(cols).to(out_slots.dtype)
    else:
        chosen = torch.gather(cand_slots, 1, cols).to(out_slots.dtype)
    out_slots.fill_(-1)
    out_slots[:, :k] = torch.where(torch.isinf(values), -1, chosen)
    return out_slots


def indexer_topk(q_idx, weights, key_pool, cand_slots, cand_len, topk, out_slots):
    logits = indexer_logits(q_idx, weights, key_pool, cand_slots, cand_len)
    return select_topk_slots(logits, cand_slots, topk, out_slots)


# ----------------------------------------------------------------------------------------
# MoE
# ----------------------------------------------------------------------------------------


def moe_route(router_logits, bias, topk: int, scaling: float, tid2eid=None, input_ids=None,
              ids_dtype: torch.dtype = torch.int32) -> Tuple[torch.Tensor, torch.Tensor]:
    scores = torch.nn.functional.softplus(router_logits.float()).sqrt()
    if tid2eid is not None:
        ids = tid2eid[input_ids.long()].long()
    else:
        select = scores + bias.float() if bias is not None else scores
        ids = topk_indices(select, topk)
    weights = torch.gather(scores, 1, ids)
    weights = weights / weights.sum(-1, keepdim=True) * scaling
    return weights, ids.to(ids_dtype)


def swiglu_clamped(gate, up, swiglu_limit: float):
    if swiglu_limit > 0:
        gate = gate.clamp(max=swiglu_limit)
        up = up.clamp(-swiglu_limit, swiglu_limit)
    return torch.nn.functional.silu(gate) * up


def local_expert_ids(ids, first_expert: int, drop_repeats: bool):
    """Routing ids [T, k] as a rank's local expert ids (ids - first_expert; another rank's
    experts fall outside [0, local count) and fused_moe skips them); with drop_repeats, every
    occurrence of an id that repeats later in its row becomes -1 (skipped), so a repeated
    expert counts once, at the gate score all its occurrences share (hash-routed layers)."""
    local = ids - first_expert if first_expert else ids.clone()
    if drop_repeats and ids.shape[1] > 1:
        later_dup = (ids[:, :, None] == ids[:, None, :]).triu(1).any(-1)
        local = local.masked_fill(later_dup, -1)
    return local


def fused_moe(x, w1, w3, w2, ids, weights, swiglu_limit, out):
    """out[t] = sum_k W2_e(swiglu(W1_e x[t], W3_e x[t]) * weights[t,k]) over e = ids[t,k]; ids
    outside [0, E) are skipped. The weight scales the activation before it is rounded to x's
    dtype and projected by W2 (DeepSeek's order, the model's too; it matters in bf16).
    Every expert runs on every token with a (mostly zero) dense gate weight: E times the work,
    but static shapes and no sync, which the CPU graph emulator needs; meant for small CPU
    models and for tests."""
    xf = x.float()
    acc = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for e in range(w1.shape[0]):
        gate = (weights.float() * (ids == e)).sum(dim=1, keepdim=True)
        h = swiglu_clamped(xf @ w1[e].float().t(), xf @ w3[e].float().t(), swiglu_limit) * gate
        acc += h.to(x.dtype).float() @ w2[e].float().t()
    out.copy_(acc.to(out.dtype))
    return out


# ----------------------------------------------------------------------------------------
# mHC (manifold-constrained hyper-connections)
# ----------------------------------------------------------------------------------------
# The same ops, in the same order, as sglang's layers/mhc.py HyperConnection, so the CPU
# model gives bit-identical results with and without the segment kernels.


def hc_sinkhorn_split(mixes, scale, base, hc: int, iters: int, eps: float):
    """mixes [T, (2+hc)*hc] -> pre [T, hc], post [T, hc], comb [T, hc, hc] (rows i -> cols j)."""
    pre = torch.sigmoid(mixes[:, :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(mixes[:, hc:2 * hc] * scale[1] + base[hc:2 * hc])
    comb = (mixes[:, 2 * hc:] * scale[2] + base[2 * hc:]).unflatten(-1, (hc, hc))
    comb = comb.softmax(dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    # Ends on a column normalisation, as DeepSeek's reference does.
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre, post, comb


def hc_pre(x, fn, scale, base, hc: int, iters: int, hc_eps: float, norm_eps: float, y_out=None):
    """x [T, hc, d] -> (y [T, d] x.dtype, post [T, hc] fp32, comb [T, hc, hc] fp32);
    y = sum_i pre_i * x_i with the gates and comb from the RMS-scaled mixes fn @ flat(x)."""
    flat = x.flatten(1).float()
    rsqrt = torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    mixes = torch.nn.functional.linear(flat, fn) * rsqrt
    pre, post, comb = hc_sinkhorn_split(mixes, scale, base, hc, iters, hc_eps)
    y = (pre.unsqueeze(-1) * flat.view(x.shape)).sum(dim=1).to(x.dtype)
    if y_out is not None:
        y_out.copy_(y)
        y = y_out
    return y, post, comb


def hc_post(f, residual, post, comb, out=None):
    """out [T, hc, d] (residual.dtype): X'_j = post_j * f + sum_i comb[i, j] * X_i."""
    mixed = torch.einsum("tij,tid->tjd", comb, residual.float())
    res = (post.unsqueeze(-1) * f.float().unsqueeze(1) + mixed).to(residual.dtype)
    if out is None:
        return res
    out.copy_(res)
    return out
