"""Triton grouped-GEMM MoE: tokens sorted by expert into a statically sized, block-padded list
(capturable: no host sync, shapes depend only on T, topk, E), then two expert-grouped GEMMs
(gate/up with the clamped SwiGLU and the routing weight fused, then down), then a top-k sum.

Semantics (shared with reference.fused_moe): out[t] = sum over k with 0 <= ids[t,k] < E of
W2_e(act(W1_e x, W3_e x) * weights[t,k]), the weighted activation rounded to x's dtype before
the down projection (DeepSeek's order; it differs from weighting after W2 in bf16). Ids outside
[0, E) are skipped: callers use that for assignments this rank does not own (another DP rank's
experts) or must not count (an expert listed twice for a token).
"""

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import pdl
from ._dot import dot_precision
from .host_math import cdiv, next_power_of_2

BLOCK_M = 64
SUM_BLOCK_D = 1024
ALIGN_ONE_KERNEL_MAX_M = 4096  # moe_align in one kernel up to this many assignments


@triton.jit
def _align_one_kernel(
    ids_ptr, sorted_ptr, block_expert_ptr, used_ptr, M, E, CAP, MAX_BLOCKS,
    BLOCK_M: tl.constexpr, MP: tl.constexpr, EP: tl.constexpr, FILL: tl.constexpr, FB: tl.constexpr,
):
    align_program(tl.program_id(0), ids_ptr, sorted_ptr, block_expert_ptr, used_ptr, M, E, CAP, MAX_BLOCKS,
                  BLOCK_M, MP, EP, FILL, FB)


@triton.jit
def _expert_groups(ids_ptr, M, E, BLOCK_M: tl.constexpr, MP: tl.constexpr, EP: tl.constexpr):
    """Every assignment's group (its expert, E for a skipped one) and, per expert (EP >= E
    columns, zero past E), its count and its padded group's start and end."""
    i = tl.arange(0, MP)
    e = tl.load(ids_ptr + i, mask=i < M, other=-1).to(tl.int32)
    valid = (i < M) & (e >= 0) & (e < E)
    # skipped and padding lanes go to bin 0 and are taken out of it again (no spare bin needed)
    counts = tl.histogram(tl.where(valid, e, 0), EP)
    ex = tl.arange(0, EP)
    counts -= tl.where(ex == 0, MP - tl.sum(valid.to(tl.int32), axis=0), 0)
    counts = tl.where(ex < E, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    return tl.where(valid, e, E), counts, padded_end - padded, padded_end


@triton.jit
def align_program(
    pid, ids_ptr, sorted_ptr, block_expert_ptr, used_ptr, M, E, CAP, MAX_BLOCKS,
    BLOCK_M: tl.constexpr, MP: tl.constexpr, EP: tl.constexpr, FILL: tl.constexpr, FB: tl.constexpr,
):
    """moe_align's result from 1 + cdiv(CAP, FILL) programs (decode and mid-size batches: the
    torch version is ~25 tiny launches, tens of microseconds, about as long as the experts'
    GEMMs at decode). Every program counts the experts from all M ids (a histogram). Program 0
    sorts the assignments by (expert, index) (a stable sort by expert) and writes each to its
    expert's padded start + its rank in the expert; program 1 + f writes the sentinel M into
    the padding slots among slots [f * FILL, (f + 1) * FILL) and block_expert for blocks
    [f * FB, (f + 1) * FB). The two kinds write disjoint slots, so no program waits for
    another."""
    group, counts, group_start, padded_end = _expert_groups(ids_ptr, M, E, BLOCK_M, MP, EP)
    if pid == 0:
        i = tl.arange(0, MP)
        keys = tl.sort(group * MP + i)  # the index below the expert: ties cannot occur
        g = keys // MP
        # sorted position s of expert g's r-th assignment is first[g] + r, its slot start[g] + r
        shift = group_start - (tl.cumsum(counts, axis=0) - counts)
        dest = i + tl.gather(shift, tl.minimum(g, EP - 1), axis=0)
        tl.store(sorted_ptr + dest, keys - g * MP, mask=g < E)
        tl.store(used_ptr, tl.sum(padded_end - group_start, axis=0))
    else:
        f = pid - 1
        p = f * FILL + tl.arange(0, FILL)
        real = (group_start[None, :] <= p[:, None]) & (p[:, None] < (group_start + counts)[None, :])
        tl.store(sorted_ptr + p, tl.zeros([FILL], tl.int32) + M,
                 mask=(p < CAP) & (tl.max(real.to(tl.int32), axis=1) == 0))
        b = f * FB + tl.arange(0, FB)  # block b: experts whose padded group ends <= b * BLOCK_M
        done = (padded_end[None, :] <= (b * BLOCK_M)[:, None]) & (tl.arange(0, EP)[None, :] < E)
        tl.store(block_expert_ptr + b, tl.sum(done.to(tl.int32), axis=1), mask=b < MAX_BLOCKS)


@triton.jit
def _local_ids_kernel(ids_ptr, out_ptr, T, K, first, BLOCK_T: tl.constexpr, KP: tl.constexpr,
                      DROP_REPEATS: tl.constexpr, PDL: tl.constexpr = False):
    pdl.enter(PDL)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    j = tl.arange(0, KP)
    live = (t[:, None] < T) & (j[None, :] < K)
    offs = t[:, None].to(tl.int64) * K + j[None, :]
    ids = tl.load(ids_ptr + offs, mask=live, other=-1)
    local = ids - first
    if DROP_REPEATS:  # an id repeated later in its row: this occurrence is dropped
        later = (j[None, None, :] > j[None, :, None]) & (j < K)[None, None, :]
        same = (ids[:, :, None] == ids[:, None, :]) & later
        local = tl.where(tl.max(same.to(tl.int32), axis=2) > 0, -1, local)
    tl.store(out_ptr + offs, local.to(out_ptr.dtype.element_ty), mask=live)


def local_expert_ids(ids: torch.Tensor, first_expert: int, drop_repeats: bool) -> torch.Tensor:
    """reference.local_expert_ids in one launch (the torch formula is five: the hash-routed
    layers' duplicate test at decode)."""
    T, K = ids.shape
    if not ids.is_contiguous():
        ids = ids.contiguous()
    out = torch.empty_like(ids)
    if T == 0:
        return out
    block_t = min(64, next_power_of_2(T))
    _local_ids_kernel[(cdiv(T, block_t),)](ids, out, T, K, int(first_expert), BLOCK_T=block_t,
                                           KP=next_power_of_2(K), DROP_REPEATS=drop_repeats, num_warps=1,
                                           **pdl.options(ids))
    return out


ALIGN_FILL = 32  # slots per sentinel program of align_program


def align_one_applies(ids) -> bool:
    """Whether moe_align runs in one kernel (align_program) for these routing ids."""
    return 0 < ids.numel() <= ALIGN_ONE_KERNEL_MAX_M and (ids.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


@dataclass
class AlignOneLaunch:
    """align_program's outputs, arguments, program count and compile-time parameters for
    routing ids (shared by its own kernel and by kernels that run it in their first programs)."""
    outputs: tuple  # (sorted_ids, block_expert, used)
    args: tuple
    constexprs: dict
    programs: int
    num_warps: int

    @classmethod
    def of(cls, ids, num_experts: int, block_m: int) -> "AlignOneLaunch":
        M, device = ids.numel(), ids.device
        max_blocks = cdiv(M, block_m) + min(num_experts, M)
        capacity = max_blocks * block_m
        sorted_ids = torch.empty(capacity, dtype=torch.int32, device=device)
        block_expert = torch.empty(max_blocks, dtype=torch.int32, device=device)
        used = torch.empty((), dtype=torch.int32, device=device)
        fills = cdiv(capacity, ALIGN_FILL)
        args = (ids.reshape(-1).contiguous(), sorted_ids, block_expert, used, M, num_experts, capacity, max_blocks)
        constexprs = dict(BLOCK_M=block_m, MP=max(16, next_power_of_2(M)), EP=max(16, next_power_of_2(num_experts)),
                          FILL=ALIGN_FILL, FB=next_power_of_2(cdiv(max_blocks, fills)))
        return cls((sorted_ids, block_expert, used), args, constexprs, 1 + fills, 4)


def moe_align(ids, num_experts: int, block_m: int = BLOCK_M, return_used: bool = False):
    """Assignment indices (t * topk + k) grouped by expert, each expert's group padded to a
    multiple of block_m; padding holds the sentinel M = T * topk. Assignments whose id is
    outside [0, num_experts) are left out entirely (no block computes them).

    Returns (sorted_ids [max_blocks * block_m] int32, block_expert [max_blocks] int32 with
    num_experts for unused blocks), and with return_used also the number of sorted_ids entries
    in use (the used blocks x block_m, an int32 0-dim device tensor: the used blocks come
    first). max_blocks = cdiv(M, block_m) + min(E, M) bounds the blocks any routing can need
    (each non-empty expert adds at most one partial block)."""
    M = ids.numel()
    device = ids.device
    max_blocks = cdiv(M, block_m) + min(num_experts, M)
    capacity = max_blocks * block_m
    if align_one_applies(ids):
        launch = AlignOneLaunch.of(ids, num_experts, block_m)
        _align_one_kernel[(launch.programs,)](*launch.args, **launch.constexprs, num_warps=launch.num_warps)
        return launch.outputs if return_used else launch.outputs[:2]
    flat = ids.reshape(-1).long()
    # Skipped assignments form one extra group (index E) that sorts after every real expert.
    group = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, group, torch.ones_like(group))  # bincount would sync on its max
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    # Where each expert's padded group starts; the skipped group "starts" at a trash slot one
    # past the list and all of its assignments land on it (their rank is not added).
    group_start = torch.cat([padded_end - padded, padded_end.new_full((1,), capacity)])
    order = torch.argsort(group, stable=True)
    sorted_group = group[order]
    rank = torch.arange(M, device=device) - (torch.cumsum(counts, 0) - counts)[sorted_group]
    dest = group_start[sorted_group] + torch.where(sorted_group < num_experts, rank, 0)
    sorted_ids = torch.full((capacity + 1,), M, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    sorted_ids = sorted_ids[:capacity]  # drop the trash slot
    block_start = torch.arange(max_blocks, device=device) * block_m
    block_expert = torch.searchsorted(padded_end, block_start, right=True).to(torch.int32)
    if return_used:
        return sorted_ids, block_expert, padded_end[-1].to(torch.int32)
    return sorted_ids, block_expert


@triton.jit
def _gate_up_kernel(
    x_ptr, w1_ptr, w3_ptr, sorted_ids_ptr, block_expert_ptr, weights_ptr, h_ptr,
    M, d, I, topk, stride_x, stride_we, stride_wn, stride_h, limit,
    NUM_EXPERTS: tl.constexpr, HAS_LIMIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr,
):
    b = tl.program_id(0)
    e = tl.load(block_expert_ptr + b).to(tl.int64)
    if e >= NUM_EXPERTS:  # a padding block past every expert's group
        return
    rows = b * BLOCK_M + tl.arange(0, BLOCK_M)
    assign = tl.load(sorted_ids_ptr + rows)
    row_mask = assign < M
    token = (assign // topk).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < I
    acc1 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc3 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, d, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < d
        xt = tl.load(x_ptr + token[:, None] * stride_x + offs_k[None, :],
                     mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w_off = e * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]
        wmask = n_mask[None, :] & k_mask[:, None]
        w1t = tl.load(w1_ptr + w_off, mask=wmask, other=0.0)
        w3t = tl.load(w3_ptr + w_off, mask=wmask, other=0.0)
        acc1 = tl.dot(xt, w1t, acc1, input_precision=DOT_PREC)
        acc3 = tl.dot(xt, w3t, acc3, input_precision=DOT_PREC)
    if HAS_LIMIT:
        acc1 = tl.minimum(acc1, limit)
        acc3 = tl.minimum(tl.maximum(acc3, -limit), limit)
    # The routing weight scales the activation in fp32, before it is rounded to the activation
    # dtype for the down GEMM: the model's (and DeepSeek's) order, not a scale after W2.
    w = tl.load(weights_ptr + assign, mask=row_mask, other=0.0).to(tl.float32)
    h = acc1 / (1.0 + tl.exp(-acc1)) * acc3 * w[:, None]
    tl.store(h_ptr + rows[:, None] * stride_h + offs_n[None, :], h.to(h_ptr.dtype.element_ty),
             mask=row_mask[:, None] & n_mask[None, :])


@triton.jit
def _down_kernel(
    h_ptr, w2_ptr, sorted_ids_ptr, block_expert_ptr, partial_ptr,
    M, d, I, stride_h, stride_we, stride_wn, stride_p,
    NUM_EXPERTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr,
):
    b = tl.program_id(0)
    e = tl.load(block_expert_ptr + b).to(tl.int64)
    if e >= NUM_EXPERTS:
        return
    rows = b * BLOCK_M + tl.arange(0, BLOCK_M)
    assign = tl.load(sorted_ids_ptr + rows)
    row_mask = assign < M
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < d
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, I, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < I
        ht = tl.load(h_ptr + rows[:, None] * stride_h + offs_k[None, :],
                     mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        wt = tl.load(w2_ptr + e * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None],
                     mask=n_mask[None, :] & k_mask[:, None], other=0.0)
        acc = tl.dot(ht, wt, acc, input_precision=DOT_PREC)
    tl.store(partial_ptr + assign.to(tl.int64)[:, None] * stride_p + offs_n[None, :],
             acc.to(partial_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


@triton.jit
def _sum_topk_kernel(
    partial_ptr, ids_ptr, out_ptr, d, topk, stride_p, stride_o,
    NUM_EXPERTS: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl.enter(PDL)
    # Skipped assignments have no partial row (no block wrote it: the buffer is uninitialised
    # there), so their loads are masked off rather than multiplied by zero (garbage may be NaN).
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = offs < d
    acc = tl.zeros([BLOCK_D], tl.float32)
    for k in range(topk):  # fixed order: deterministic, no atomics
        a = t * topk + k
        e = tl.load(ids_ptr + a)
        # Row length d for a computed assignment, 0 for a skipped one (an int, not a scalar bool
        # and-ed into the block mask: the interpreter rejects that mask's dtype).
        n = d * ((e >= 0) & (e < NUM_EXPERTS)).to(tl.int32)
        row = tl.load(partial_ptr + a * stride_p + offs, mask=offs < n, other=0.0)
        acc += row.to(tl.float32)
    tl.store(out_ptr + t * stride_o + offs, acc.to(out_ptr.dtype.element_ty), mask=d_mask)


def sum_topk(partial, ids, out, num_experts: int):
    """out [T, d] <- each token's top-k partial rows (partial [T * topk, d], ids [T, topk])
    summed in fp32, in top-k order (deterministic); assignments whose id is outside
    [0, num_experts) add nothing. Shared by every MoE here (fused_moe and the FP4 variants)."""
    T, d = out.shape
    block_d = min(SUM_BLOCK_D, next_power_of_2(d))
    _sum_topk_kernel[(T, cdiv(d, block_d))](
        partial, ids.reshape(-1).contiguous(), out, d, ids.shape[1], partial.stride(0), out.stride(0),
        NUM_EXPERTS=num_experts, BLOCK_D=block_d, num_warps=4, **pdl.options(partial))
    return out


@dataclass(frozen=True)
class RoutedRows:
    """The routed experts' output before its top-k sum: partial [T * topk, d] (row t * topk + k
    is assignment k of token t), ids [T, topk] (assignments outside [0, num_experts) add
    nothing). A backend hands this out instead of the sum when the consumer sums the rows in
    its own launch (the shared expert's down GEMV at decode, fp8_gemv's ADD step); `sum` is
    the separate launch, for every other consumer."""

    partial: torch.Tensor
    ids: torch.Tensor
    num_experts: int

    def sum(self) -> torch.Tensor:
        """fp32 [T, d]: sum_topk's result."""
        T, d = self.ids.shape[0], self.partial.shape[1]
        out = torch.empty(T, d, dtype=torch.float32, device=self.partial.device)
        return sum_topk(self.partial, self.ids, out, self.num_experts)


def fused_moe(x, w1, w3, w2, ids, weights, swiglu_limit, out, block_n: int = 64,
              block_k: int = 64, num_warps: int = 8, num_stages: int = 3):
    """out [T, d] (any float dtype) <- the routed experts' sum (see the module docstring).
    ids [T, topk] (int32/int64; outside [0, E) = skip), weights [T, topk]. Returns out."""
    # Default tiles: the largest that compile for sm_90 without spills (two fp32 accumulators
    # in the gate/up kernel); see sgl-kernel/benchmark/sm90_resources.py.
    T, d = x.shape
    E, I, _ = w1.shape
    topk = ids.shape[1]
    assert x.stride(-1) == 1 and w1.is_contiguous() and w3.is_contiguous() and w2.is_contiguous()
    assert w1.shape == w3.shape == (E, I, d) and w2.shape == (E, d, I)
    assert out.shape == (T, d) and out.stride(-1) == 1
    if T == 0:
        return out
    M = T * topk
    sorted_ids, block_expert = moe_align(ids, E)
    max_blocks = block_expert.shape[0]
    # h in the activation dtype (the down GEMM's input); the per-assignment partial outputs
    # too, summed over top-k in fp32 by the last kernel. Both are written only where a block
    # computed them and read only there.
    h = torch.empty(sorted_ids.shape[0], I, dtype=x.dtype, device=x.device)
    partial = torch.empty(M, d, dtype=x.dtype, device=x.device)
    weights_flat = weights.reshape(-1).contiguous()
    _gate_up_kernel[(max_blocks, cdiv(I, block_n))](
        x, w1, w3, sorted_ids, block_expert, weights_flat, h, M, d, I, topk, x.stride(0),
        w1.stride(0), w1.stride(1), h.stride(0), float(swiglu_limit),
        NUM_EXPERTS=E, HAS_LIMIT=swiglu_limit > 0, BLOCK_M=BLOCK_M, BLOCK_N=block_n,
        BLOCK_K=block_k, DOT_PREC=dot_precision(x.dtype), num_warps=num_warps,
        num_stages=num_stages,
    )
    _down_kernel[(max_blocks, cdiv(d, block_n))](
        h, w2, sorted_ids, block_expert, partial, M, d, I, h.stride(0),
        w2.stride(0), w2.stride(1), partial.stride(0),
        NUM_EXPERTS=E, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k,
        DOT_PREC=dot_precision(x.dtype), num_warps=num_warps, num_stages=num_stages,
    )
    return sum_topk(partial, ids, out, E)
