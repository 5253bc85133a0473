"""The MoE router after its logits GEMM, one launch: sqrt-softplus scores, the selection-only
bias, the top-k (or the hash table's experts), the normalised weights times the scaling.

reference.moe_route's contract; in torch it is a dozen small launches per layer (softplus,
sqrt, add, the keyed top-k's bit tricks, gather, sum, divide, multiply), each a few µs at
decode sizes. One program per token row holds the row's E scores in registers.

Numerics: exp and log1p from libdevice (the functions torch's softplus calls), an IEEE square
root and division, fp32 throughout. The selection is reference.topk_indices's order: score
descending, exact ties by expert id ascending, -0.0 as +0.0, found by k rounds of a max over
the same order-preserving int64 keys; on an H200 the experts equal the torch path's at 1, 64
and 4096 tokens. The weights' six-term sum runs in selection order, which torch's reduction
need not take: they agree to a few ulps, not bit for bit.

Graph-safe: no host syncs, shapes depend only on T, E and k.
"""

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from . import pdl
from .host_math import next_power_of_2

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _route_kernel(
    logits_ptr, bias_ptr, tid2eid_ptr, input_ids_ptr, weights_ptr, ids_ptr,
    E, stride_l, stride_h, stride_w, stride_i, scaling,
    K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, HASH: tl.constexpr, LIBDEVICE: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl.enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    live = cols < E
    logit = tl.load(logits_ptr + t * stride_l + cols, mask=live, other=0.0).to(tl.float32)
    if LIBDEVICE:
        soft = libdevice.log1p(libdevice.exp(logit))
    else:  # the interpreter has no libdevice: numpy's exp and log, log1p by Goldberg's identity
        u = 1.0 + tl.exp(logit)
        soft = tl.where(u == 1.0, tl.exp(logit), tl.log(u) * (tl.exp(logit) / (u - 1.0)))
    soft = tl.where(logit > 20.0, logit, soft)  # softplus's default threshold: above it, x itself
    score = tl.sqrt_rn(soft)
    slots = tl.arange(0, BLOCK_K)
    weights = tl.zeros([BLOCK_K], tl.float32)
    ids = tl.zeros([BLOCK_K], tl.int64)
    if HASH:
        tok = tl.load(input_ids_ptr + t).to(tl.int64)
        for j in tl.static_range(K):
            e = tl.load(tid2eid_ptr + tok * stride_h + j).to(tl.int64)
            w = tl.sum(tl.where(cols == e, score, 0.0), axis=0)
            weights = tl.where(slots == j, w, weights)
            ids = tl.where(slots == j, e, ids)
    else:
        select = score
        if HAS_BIAS:
            select = select + tl.load(bias_ptr + cols, mask=live, other=0.0).to(tl.float32)
        bits = (select + 0.0).to(tl.int32, bitcast=True)  # + 0.0: -0.0 becomes +0.0
        ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)
        key = (ordered << 32) + (E - 1 - cols).to(tl.int64)
        key = tl.where(live, key, -9223372036854775807 - 1)
        for j in tl.static_range(K):
            best = tl.max(key, axis=0)
            e = (E - 1 - (best & 0xFFFFFFFF)).to(tl.int64)
            w = tl.sum(tl.where(cols == e, score, 0.0), axis=0)
            weights = tl.where(slots == j, w, weights)
            ids = tl.where(slots == j, e, ids)
            key = tl.where(cols == e, -9223372036854775807 - 1, key)
    total = tl.sum(tl.where(slots == 0, weights, 0.0), axis=0)
    for j in tl.static_range(1, K):  # selection order
        total += tl.sum(tl.where(slots == j, weights, 0.0), axis=0)
    weights = tl.div_rn(weights, tl.zeros([BLOCK_K], tl.float32) + total) * scaling
    keep = slots < K
    tl.store(weights_ptr + t * stride_w + slots, weights, mask=keep)
    tl.store(ids_ptr + t * stride_i + slots, ids.to(ids_ptr.dtype.element_ty), mask=keep)


def moe_route(router_logits, bias, topk: int, scaling: float, tid2eid=None, input_ids=None,
              ids_dtype: torch.dtype = torch.int32):
    """(weights [T, topk] fp32, ids [T, topk] ids_dtype): reference.moe_route in one launch."""
    T, E = router_logits.shape
    if router_logits.stride(-1) != 1:
        router_logits = router_logits.contiguous()
    weights = torch.empty(T, topk, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(T, topk, dtype=ids_dtype, device=router_logits.device)
    if T == 0:
        return weights, ids
    hashed = tid2eid is not None
    if hashed and (input_ids is None or tid2eid.shape[1] != topk or tid2eid.stride(-1) != 1):
        raise ValueError(f"moe_route: a hash table needs input_ids and {topk} contiguous experts per token, got "
                         f"{None if tid2eid is None else tuple(tid2eid.shape)}")
    has_bias = bias is not None and not hashed
    _route_kernel[(T,)](
        router_logits, bias if has_bias else router_logits, tid2eid if hashed else router_logits,
        input_ids if hashed else router_logits, weights, ids,
        E, router_logits.stride(0), tid2eid.stride(0) if hashed else 0, weights.stride(0), ids.stride(0),
        float(scaling), K=topk, BLOCK_E=next_power_of_2(E), BLOCK_K=next_power_of_2(topk),
        HAS_BIAS=has_bias, HASH=hashed, LIBDEVICE=not _INTERPRET, num_warps=4 if E <= 512 else 8,
        **pdl.options(router_logits))
    return weights, ids
