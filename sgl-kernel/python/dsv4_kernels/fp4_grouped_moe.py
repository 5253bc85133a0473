"""fp4_moe's "grouped" variant, for large batches: FP4 experts decoded to bf16 a group at a
time, multiplied by torch._grouped_mm (CUTLASS on sm90), where the other variants decode
inside their own GEMMs (ALU-bound at large T: 94 TFLOP/s at T = 4096, Flash width).

Per call (graph-safe: no host syncs, every shape fixed by (T, topk, E)):
1. Route: the T * topk assignments sorted by expert (stable argsort of the id, skipped ids
   (outside [0, E)) keyed E: they sort last and lie outside every group), per-expert counts
   by scatter_add (bincount would sync), their cumulative ends, the row bounds of each group
   of GROUP_EXPERTS experts and each expert's end relative to its group's first row (the
   int32 `offs` torch._grouped_mm takes).
2. Activations: x rounded to FP8 per 128 with act_quant (round_act: exact in x's dtype).
3. For each group g of experts [g G, (g+1) G): _decode_experts_kernel writes W1 | W3 of the
   group as bf16 [G, d, 2 inter] (gate columns then up columns, N contiguous: one grouped GEMM
   gives both; exact, e2m1 x a power of two); the group's rows are gathered from x into a
   static-capacity buffer [T * topk, d] (only the first bounds[g+1] - bounds[g] rows are real);
   grouped_mm computes gate | up for those rows; _swiglu_rows_kernel writes the weighted,
   clamped SwiGLU (rounded to x's dtype, then FP8 per 128 with act_quant) over the gate
   columns in place; W2 of the group is decoded over the same workspace (the gate/up GEMM that
   read it is earlier on the stream); grouped_mm computes the down projection; its rows are
   scattered to the per-assignment partials. moe.sum_topk sums them in top-k order.

Why a static-capacity buffer per group: a group's rows start at a device-side offset, and
grouped_mm's first group starts at row 0 of its input (its data pointer is host-side), so the
rows are gathered to a buffer whose capacity is the worst case (every assignment in one group:
T * topk rows, duplicates allowed). grouped_mm reads only the rows its offsets cover and leaves
the others uninitialised; the row kernels loop over the real rows only (a trip count read on
the device), so the capacity costs memory, not time.

Numerics: the weights and the FP8-rounded activations are exact, as in the other variants.
torch._grouped_mm accumulates in fp32 but returns its input dtype (bf16 on the GPU; an fp32
output is refused), so gate and up are rounded to bf16 before the SwiGLU and each assignment's
down partial to bf16 before the fp32 top-k sum: a bf16 rounding (2^-9 relative) more on each
than the bf16 variant, whose GEMM outputs stay fp32. With fp32 x (CPU tests) every step is fp32
and the result is the reference's up to summation order. The partials are kept in x's dtype
(bf16 holds a bf16 GEMM output exactly; half the bytes of fp32).

Workspace (bf16 at Flash dims d = 4096, inter = 2048, G = 16): the decoded group, G * d *
2 inter * 2 B = 512 MiB (W2's G * inter * d reuses it); row buffers 16 KiB per assignment live
at once (gathered x or the down output, 8 KiB; gate | up with h in place, 8 KiB) plus the
partials, 8 KiB: 24 KiB x T * topk (576 MiB at T = 4096, top-6), where the bf16 variant holds
20 KiB (fp32 partials + h). Why G = 16: 32 would double the decoded workspace to 1 GiB; fewer
experts per GEMM mean more launches (10 per group) and fewer tiles per launch: torch picks its
128 x 256 CUTLASS tile (from the capacity / G, not the real rows), so an expert with <= 128
rows is 16 tiles at N = 4096 and a wave on 132 SMs needs ~8 such experts. Not measured:
bench_quant.py times G = 8 and 32 beside 16 (grouped_release_g8 / _g32).

Opt-in (config {"overlap": True}, CUDA, not measured): the next group's decode on a side stream
during this group's GEMMs, with two slots of decoded weights (grouped_fp4_moe's docstring).

Like the bf16 variant, an e8m0 byte 0 or 1 (2^-127, 2^-126: no real scale) decodes as 0.

On the GPU the variant needs bf16 x (torch._grouped_mm's CUTLASS path; its fallback for other
dtypes reads the offsets on the host). Elsewhere, and for other dtypes (refused under graph
capture), a loop of torch.mm per expert stands in for grouped_mm: same structure and
numerics, host reads of the offsets (tests only).
"""

import torch
import triton
import triton.language as tl

from .fp4_moe import _chunk_scale, _chunks, _e2m1_scaled, _load_codes, _step_scales
from .fp8_gemm import INV_E4M3_MAX, QBLOCK, e4m3_bits, pow2_recip, pow2_scale, round_act
from .host_math import cdiv, next_power_of_2
from .moe import sum_topk

GROUP_EXPERTS = 16  # experts decoded and multiplied per grouped GEMM (module docstring)
# Gather / SwiGLU / scatter: BLOCK_R rows x BLOCK_D columns (128 for the SwiGLU: one FP8
# block) per step; ROW_PROGRAMS row slots per column block, each looping over the group's row
# blocks (16 experts at T = 4096, top-6 of 256: ~1536 rows = 192 blocks over 128 slots x 8
# column blocks), so the grid is neither mostly empty programs (one per block of the capacity)
# nor a few long ones.
BLOCK_R = 8
BLOCK_D = 512
ROW_PROGRAMS = 128
DECODE_BLOCK_N = 64  # weight rows per decode program (x 32 * CHUNKS inputs)
_SIDE_STREAMS: dict = {}  # overlap=True: device index -> its side stream


@triton.jit
def _decode_experts_kernel(w_ptr, s_ptr, out_ptr, e0, N, stride_we, stride_wn, stride_se,
                           stride_sn, stride_oe, stride_ok, stride_on, col0,
                           BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr):
    """out[e, k, col0 + n] = W[e0 + e][n, k] decoded (e2m1 x e8m0, exact in out's dtype) for
    this program's BLOCK_N rows n and 32 * CHUNKS inputs k: a transposed copy, so grouped_mm
    reads [G, K, N] with N contiguous (the faster of its two layouts in
    benchmark/probe_torch_gemm.py)."""
    e = tl.program_id(0).to(tl.int64)
    src = e0 + e
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    k_base = tl.program_id(2) * (32 * CHUNKS)
    sb_step = _step_scales(s_ptr, src, offs_n, n_mask, k_base, stride_se, stride_sn, CHUNKS)
    out_rows = out_ptr + e * stride_oe + (col0 + offs_n)[:, None].to(tl.int64) * stride_on
    for c in tl.static_range(CHUNKS):
        k0 = k_base + c * 32
        code = _load_codes(w_ptr, src, offs_n, n_mask, k0, stride_we, stride_wn)
        val = _e2m1_scaled(code, _chunk_scale(sb_step, c, CHUNKS)[:, None])
        kk = (k0 + tl.arange(0, 32)).to(tl.int64)
        tl.store(out_rows + kk[None, :] * stride_ok, val.to(out_ptr.dtype.element_ty),
                 mask=n_mask[:, None])


@triton.jit
def _group_span(bounds_ptr, g):
    """(first sorted row, row count) of group g."""
    start = tl.load(bounds_ptr + g)
    return start, tl.load(bounds_ptr + g + 1) - start


@triton.jit
def _block_rows(order_ptr, start, n, r0, BLOCK_R: tl.constexpr):
    """Rows r0 .. r0 + BLOCK_R - 1 of the group's buffer: (r int64, mask r < n, assignment ids
    order[start + r])."""
    r = r0 + tl.arange(0, BLOCK_R)
    r_mask = r < n
    assign = tl.load(order_ptr + start + r, mask=r_mask, other=0)
    return r.to(tl.int64), r_mask, assign


@triton.jit
def _gather_rows_kernel(a_ptr, order_ptr, bounds_ptr, g, rows_ptr, topk, d, stride_a,
                        stride_r, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """rows[r, cols] = a[token of the group's r-th assignment, cols] for the group's real rows
    (program (i, j): row blocks i, i + P, ... of the count read on the device, columns block
    j)."""
    start, n = _group_span(bounds_ptr, g)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    c_mask = cols < d
    for r0 in range(tl.program_id(0) * BLOCK_R, n, tl.num_programs(0) * BLOCK_R):
        r, r_mask, assign = _block_rows(order_ptr, start, n, r0, BLOCK_R)
        token = (assign // topk).to(tl.int64)
        mask = r_mask[:, None] & c_mask[None, :]
        v = tl.load(a_ptr + token[:, None] * stride_a + cols[None, :], mask=mask)
        tl.store(rows_ptr + r[:, None] * stride_r + cols[None, :], v, mask=mask)


@triton.jit
def _swiglu_rows_kernel(gu_ptr, order_ptr, bounds_ptr, g, weights_ptr, inter, stride_gu,
                        limit, HAS_LIMIT: tl.constexpr, ACT_QUANT: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr):
    """gu[r, cols] <- x's dtype(silu(min(gate, L)) * clamp(up, -L, L) * routing weight) with
    gate = gu[r, cols], up = gu[r, inter + cols], in fp32 as _fp4_gate_up_kernel does; with
    ACT_QUANT (BLOCK_I = 128: one block per program) then rounded to FP8 per 128 as
    fp8_gemm.round_act does. In place: a program reads and writes only its own rows and
    columns. Rows as in _gather_rows_kernel."""
    start, n = _group_span(bounds_ptr, g)
    cols = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    c_mask = cols < inter
    for r0 in range(tl.program_id(0) * BLOCK_R, n, tl.num_programs(0) * BLOCK_R):
        r, r_mask, assign = _block_rows(order_ptr, start, n, r0, BLOCK_R)
        w = tl.load(weights_ptr + assign, mask=r_mask, other=0.0).to(tl.float32)
        mask = r_mask[:, None] & c_mask[None, :]
        row = gu_ptr + r[:, None] * stride_gu + cols[None, :]
        gate = tl.load(row, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(row + inter, mask=mask, other=0.0).to(tl.float32)
        if HAS_LIMIT:
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
        h = (gate / (1.0 + tl.exp(-gate)) * up * w[:, None]).to(gu_ptr.dtype.element_ty)
        if ACT_QUANT:
            hf = h.to(tl.float32)
            scale = pow2_scale(tl.max(tl.abs(hf), axis=1), INV_E4M3_MAX)
            v = tl.minimum(tl.maximum(hf * pow2_recip(scale)[:, None], -448.0), 448.0)
            q = e4m3_bits(v).to(tl.float8e4nv, bitcast=True).to(tl.float32)
            h = (q * scale[:, None]).to(gu_ptr.dtype.element_ty)
        tl.store(row, h, mask=mask)


@triton.jit
def _scatter_rows_kernel(y_ptr, order_ptr, bounds_ptr, g, partial_ptr, d, stride_y,
                         stride_p, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """partial[the group's r-th assignment, cols] = y[r, cols] for the group's real rows (rows
    and columns as in _gather_rows_kernel)."""
    start, n = _group_span(bounds_ptr, g)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    c_mask = cols < d
    for r0 in range(tl.program_id(0) * BLOCK_R, n, tl.num_programs(0) * BLOCK_R):
        r, r_mask, assign = _block_rows(order_ptr, start, n, r0, BLOCK_R)
        mask = r_mask[:, None] & c_mask[None, :]
        v = tl.load(y_ptr + r[:, None] * stride_y + cols[None, :], mask=mask)
        tl.store(partial_ptr + assign.to(tl.int64)[:, None] * stride_p + cols[None, :], v,
                 mask=mask)


def route_by_expert(ids, num_experts: int, group_experts: int):
    """Device-side routing (no host sync, shapes fixed by ids' shape and E): (order int32
    [T * topk]: assignment ids sorted by expert, stable, skipped ones last; bounds int32
    [groups + 1]: first sorted row of each group of group_experts experts, then the end of the
    last (the count of routed assignments); offs int32 [E]: each expert's end row relative to
    its group's first row, grouped_mm's offsets for the group's slice)."""
    E, G = num_experts, group_experts
    dev = ids.device
    flat = ids.reshape(-1).long()
    key = torch.where((flat >= 0) & (flat < E), flat, E)
    order = torch.argsort(key, stable=True).to(torch.int32)
    counts = torch.zeros(E + 1, dtype=torch.long, device=dev)
    counts.scatter_add_(0, key, torch.ones_like(key))
    ends = torch.cumsum(counts[:E], 0)
    groups = cdiv(E, G)
    last = (torch.arange(1, groups + 1, device=dev) * G).clamp_(max=E) - 1
    bounds = torch.cat([ends.new_zeros(1), ends[last]])
    offs = ends - bounds[torch.arange(E, device=dev) // G]
    return order, bounds.to(torch.int32), offs.to(torch.int32)


def _grouped_mm(a, b, offs):
    """a [rows, K] @ b[e] for rows [offs[e-1], offs[e]) (from row 0 for e = 0) -> [rows, N] in
    a's dtype; rows past the last offset undefined. torch._grouped_mm for bf16 on CUDA; else a loop of
    torch.mm reading offs on the host (rows past the end NaN: they must never be read; under
    graph capture fp4_fused_moe refuses non-bf16 x before this is reached)."""
    if a.is_cuda and a.dtype == torch.bfloat16:
        return torch._grouped_mm(a, b, offs=offs)
    out = torch.full((a.shape[0], b.shape[2]), float("nan"), dtype=a.dtype, device=a.device)
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            torch.mm(a[start:end], b[e], out=out[start:end])
        start = end
    return out


def _decode_group(w, s, e0: int, n_e: int, out, col0: int):
    """out[:n_e, :, col0:col0 + N] <- experts [e0, e0 + n_e) of the FP4 weight w [E, N, K/2]
    (scales s) transposed to [K, N], in out's dtype."""
    _, N, half_k = w.shape
    chunks = _chunks(2 * half_k)
    _decode_experts_kernel[(n_e, cdiv(N, DECODE_BLOCK_N), 2 * half_k // (32 * chunks))](
        w.view(torch.int8), s.view(torch.uint8), out, e0, N, w.stride(0), w.stride(1),
        s.stride(0), s.stride(1), out.stride(0), out.stride(1), out.stride(2), col0,
        BLOCK_N=DECODE_BLOCK_N, CHUNKS=chunks, num_warps=4)


def _side_stream(device) -> "torch.cuda.Stream":
    """One side stream per GPU for overlap=True, made on first use (the eager warm-up before a
    capture: a stream is better not created inside one)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SIDE_STREAMS:
        _SIDE_STREAMS[idx] = torch.cuda.Stream(device=idx)
    return _SIDE_STREAMS[idx]



def grouped_fp4_moe(x, w1, w1_scale, w3, w3_scale, w2, w2_scale, ids, weights, limit, out,
                    act_quant: bool, group_experts: int = GROUP_EXPERTS, overlap: bool = False):
    """fp4_fused_moe(..., variant="grouped") (arguments checked there; T > 0): out fp32 [T, d].
    group_experts: experts per decoded group (GROUP_EXPERTS; bench_quant times others).
    overlap (CUDA only, opt-in, not measured): decode group g + 1 on a side stream while group
    g's GEMMs run, in two slots of separate W1 | W3 and W2 buffers (2 x G x 48 MiB at Flash
    dims: use G = 8), ordered by events (a slot is refilled only after the down GEMM that read
    it; a GEMM waits for its group's decode); the side stream rejoins before returning, so the
    whole call captures into one graph."""
    T, d = x.shape
    E, inter, _ = w1.shape
    topk = ids.shape[1]
    M = T * topk
    if group_experts < 1:
        raise ValueError(f"fp4_fused_moe: group_experts must be >= 1, got {group_experts}")
    G = min(group_experts, E)
    n_groups = cdiv(E, G)
    dev, dt = x.device, x.dtype
    overlap = overlap and x.is_cuda
    order, bounds, offs = route_by_expert(ids, E, G)
    a = round_act(x) if act_quant else x
    weights_flat = weights.reshape(-1).float().contiguous()
    partial = torch.empty(M, d, dtype=dt, device=dev)
    # Row kernels: ROW_PROGRAMS row slots (fewer at small T) x column blocks; each slot loops
    # over the group's real row blocks, whose count only the device knows.
    slots = min(cdiv(M, BLOCK_R), ROW_PROGRAMS)
    block_d = min(BLOCK_D, next_power_of_2(d))
    grid_d = (slots, cdiv(d, block_d))
    grid_i = (slots, cdiv(inter, QBLOCK))

    def decode(g, w13, w2_dec, part):
        e0, n_e = g * G, min(G, E - g * G)
        if part in ("all", "gate_up"):
            _decode_group(w1, w1_scale, e0, n_e, w13, 0)
            _decode_group(w3, w3_scale, e0, n_e, w13, inter)
        if part in ("all", "down"):
            _decode_group(w2, w2_scale, e0, n_e, w2_dec, 0)

    if overlap:
        bufs = [(torch.empty(G, d, 2 * inter, dtype=dt, device=dev),
                 torch.empty(G, inter, d, dtype=dt, device=dev)) for _ in range(2)]
        main, side = torch.cuda.current_stream(dev), _side_stream(dev)
        ready, freed = [None] * n_groups, [None, None]

        def prefetch(g):
            with torch.cuda.stream(side):
                if freed[g % 2] is None:  # first use: fork from main (joins a capture)
                    side.wait_stream(main)
                else:  # after the last GEMM that read this slot
                    side.wait_event(freed[g % 2])
                decode(g, *bufs[g % 2], "all")
                ready[g] = torch.cuda.Event()
                ready[g].record(side)
        prefetch(0)
    else:
        # One workspace: W2 of a group over its W1 | W3 once the gate/up GEMM is queued.
        workspace = torch.empty(G * d * 2 * inter, dtype=dt, device=dev)
        shared = (workspace.view(G, d, 2 * inter), workspace[:G * inter * d].view(G, inter, d))
    for g in range(n_groups):
        e0, n_e = g * G, min(G, E - g * G)
        if overlap:
            if g + 1 < n_groups:
                prefetch(g + 1)
            w13, w2_dec = bufs[g % 2]
        else:
            w13, w2_dec = shared
            decode(g, w13, w2_dec, "gate_up")
        rows = torch.empty(M, d, dtype=dt, device=dev)
        _gather_rows_kernel[grid_d](a, order, bounds, g, rows, topk, d, a.stride(0),
                                    rows.stride(0), BLOCK_R=BLOCK_R, BLOCK_D=block_d,
                                    num_warps=4)
        group_offs = offs[e0:e0 + n_e]
        if overlap:  # the gather above needs no weights; the GEMMs need the group's decode
            main.wait_event(ready[g])
        gate_up = _grouped_mm(rows, w13[:n_e], group_offs)
        del rows  # its block serves the down GEMM's output
        _swiglu_rows_kernel[grid_i](gate_up, order, bounds, g, weights_flat, inter,
                                    gate_up.stride(0), float(limit), HAS_LIMIT=limit > 0,
                                    ACT_QUANT=act_quant, BLOCK_R=BLOCK_R, BLOCK_I=QBLOCK,
                                    num_warps=4)
        if not overlap:
            decode(g, w13, w2_dec, "down")
        y = _grouped_mm(gate_up[:, :inter], w2_dec[:n_e], group_offs)
        del gate_up
        if overlap:
            freed[g % 2] = torch.cuda.Event()
            freed[g % 2].record(main)
        _scatter_rows_kernel[grid_d](y, order, bounds, g, partial, d, y.stride(0),
                                     partial.stride(0), BLOCK_R=BLOCK_R, BLOCK_D=block_d,
                                     num_warps=4)
        del y
    if overlap:
        main.wait_stream(side)  # rejoin: nothing of the side stream outlives the call
    return sum_topk(partial, ids, out, E)
