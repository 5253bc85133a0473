"""Plain-torch DSV4 ops of the model's own segment code (CPU, and CUDA with
--segment-kernels off): static-shaped, as they run inside captured segments. The attention
core's torch version is sgl-kernel's reference (dsv4_kernels.reference.sparse_attn_with_sink),
which the backend calls directly."""

from __future__ import annotations

import torch
from dsv4_kernels.reference import topk_indices

# A finite stand-in for -inf so fully padded rows stay finite (softmax of equal values);
# exp(NEG - max) underflows to exactly 0 wherever a real score is present.
NEG = -1e30


def compressor_pool(state_kv: torch.Tensor, state_score: torch.Tensor, kv_new: torch.Tensor,
                    score_new: torch.Tensor, gather_idx: torch.Tensor, ratio: int) -> torch.Tensor:
    """Softmax-pool each emission's source rows (see DSV4CompressorMetadata.gather_idx).

    state_* [rows, R, C] fp32 ring; *_new [T, C] fp32 fresh; gather_idx [E, R]. Returns [E, D] fp32
    with D = C for ratio 128 and C/2 for ratio 4 (block i-1 read through channels [0:D],
    block i through [D:2D]).
    """
    E, R = gather_idx.shape
    C = kv_new.shape[-1]
    flat_kv, flat_sc = state_kv.reshape(-1, C), state_score.reshape(-1, C)
    from_state = gather_idx >= 0
    fresh_row = (-gather_idx - 2).clamp(min=0).long()
    state_row = gather_idx.clamp(min=0).long()
    kv = torch.where(from_state[..., None], flat_kv[state_row], kv_new[fresh_row])
    sc = torch.where(from_state[..., None], flat_sc[state_row], score_new[fresh_row])
    empty = (gather_idx == -1)[..., None]
    kv = kv.masked_fill(empty, 0.0)
    sc = sc.masked_fill(empty, NEG).clamp(min=NEG)  # ring rows never written hold -inf
    if ratio == 4:
        D = C // 2
        kv = torch.cat([kv[:, :R // 2, :D], kv[:, R // 2:, D:]], dim=1)
        sc = torch.cat([sc[:, :R // 2, :D], sc[:, R // 2:, D:]], dim=1)
    return (kv * sc.softmax(dim=1)).sum(dim=1)


def scatter_rows_(dst: torch.Tensor, loc: torch.Tensor, rows: torch.Tensor, trash: int) -> None:
    """dst[loc] = rows, with -1 locations sent to a trash row nobody reads (static shape)."""
    safe = torch.where(loc >= 0, loc, trash).long()
    dst.index_put_((safe,), rows.to(dst.dtype))


def indexer_topk(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, cand_slots: torch.Tensor,
                 cand_len: torch.Tensor, topk: int) -> torch.Tensor:
    """Top-min(topk, cand_len) c4 slots by I(t,s) = sum_h w[t,h] relu(q[t,h] . k[s]); -1 pad.

    Static output [T, topk]; any order. q [T, nH, Di]; weights [T, nH] fp32; keys [S4, Di].
    """
    T, C = cand_slots.shape
    k = keys[cand_slots.clamp(min=0).long()].float()  # [T, C, Di]
    logits = torch.einsum("thd,tcd->thc", q.float(), k).relu_()
    score = (logits * weights.float()[..., None]).sum(dim=1)
    col = torch.arange(C, device=score.device)[None, :]
    visible = col < cand_len[:, None]
    score = score.masked_fill(~visible, float("-inf"))
    kk = min(topk, C)
    # Deterministic: exact ties (all heads clamped to 0 by the relu) go to the earlier
    # candidate, whatever the device, the list width (batch, graph bucket) or graph vs eager.
    order = topk_indices(score, kk)
    chosen = cand_slots.gather(1, order)
    rank = torch.arange(kk, device=score.device)[None, :]
    chosen = torch.where(rank < torch.clamp(cand_len, max=kk)[:, None], chosen, -1)
    if kk < topk:
        chosen = torch.cat([chosen, chosen.new_full((T, topk - kk), -1)], dim=1)
    return chosen.int()
