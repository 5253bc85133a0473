"""The FP8 GEMV for decode rows (fp8_gemv.py) against quant_reference.

Its products are the reference's exactly (e4m3 x e4m3 in release numerics, e4m3 x pow2 scale
x fp32 x weight-only) and it sums each 128-block in fp32, so it differs from the reference in
the order of fp32 sums only: rtol 1e-5 on fp32 outputs, 2^-7 on bf16 ones (the interpreter's
fp32 -> bf16 cast truncates where the GPU rounds).
"""

import pytest
import torch

from dsv4_kernels import quant_reference as Q
from kernel_test_utils import require_triton


def _weight(N, K, device):
    q, s = Q.quantize_fp8_weight(torch.randn(N, K) * torch.linspace(0.05, 2, K))
    return q.to(device), s.to(device)


@pytest.mark.parametrize("M,N,K,act_quant,dtype", [
    (1, 200, 384, True, torch.float32),      # one token, a ragged last weight block
    (3, 130, 1280, True, torch.bfloat16),    # K beyond one 1024-deep slab, bf16 x
    (4, 256, 256, True, torch.float32),
    (2, 96, 512, False, torch.float32),      # weight-only
    (4, 128, 1152, False, torch.bfloat16),
])
def test_gemv_matches_reference(device, M, N, K, act_quant, dtype):
    require_triton()
    from dsv4_kernels import fp8_gemv
    w, s = _weight(N, K, device)
    x = (torch.randn(M, K) * torch.logspace(-3, 1, K)).to(device=device, dtype=dtype)
    y = fp8_gemv.fp8_gemv(x, w, s, act_quant)
    ref = Q.fp8_block_linear_ref(x.float(), w, s, act_quant)
    assert y.shape == (M, N) and y.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-4)
    else:
        torch.testing.assert_close(y.float(), ref, rtol=2 ** -7, atol=1e-3)


def test_rows_per_program_only_divide_the_work(device):
    """BLOCK_N only divides the output rows among programs: every choice gives the reference's
    sums (compiled, the tile's register layout may reorder a block's fp32 sum: 3.8e-6 apart
    measured on an H200 between 1 and 16 rows), and a repeated launch gives the same bits."""
    require_triton()
    from dsv4_kernels import fp8_gemv
    w, s = _weight(256, 512, device)
    x = torch.randn(2, 512, device=device)
    ref = Q.fp8_block_linear_ref(x, w, s, True)
    for bn in (1, 4, 16):
        cfg = dict(BLOCK_N=bn, BLOCK_K=512, num_warps=4, num_stages=2)
        got = fp8_gemv.fp8_gemv(x, w, s, True, cfg)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)
        assert torch.equal(fp8_gemv.fp8_gemv(x, w, s, True, cfg), got), bn


def test_grouped_gemv_is_each_group_through_its_rows(device):
    require_triton()
    from dsv4_kernels import fp8_gemv
    T, G, n, K = 2, 3, 128, 384
    w, s = _weight(G * n, K, device)
    s[1] *= 4.0  # the groups' scales differ
    wide = torch.randn(T, 2 * G, K, device=device)
    x = wide[:, ::2]  # a strided x is read in place
    y = fp8_gemv.fp8_grouped_gemv(x, w, s)
    assert y.shape == (T, G, n)
    for g in range(G):
        want = Q.fp8_block_linear_ref(x[:, g].contiguous(), w[g * n:(g + 1) * n], s[g:g + 1], False)
        torch.testing.assert_close(y[:, g], want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("act_quant", [True, False])
def test_a_pair_in_one_launch_is_each_linear_alone(device, act_quant):
    """Two weights of one shape on the same x, wherever each lives: the same bits as two GEMVs."""
    require_triton()
    from dsv4_kernels import fp8_gemv
    (wa, sa), (wb, sb) = _weight(256, 384, device), _weight(256, 384, device)
    sb[1] *= 8.0
    x = torch.randn(1, 384, device=device)
    both = fp8_gemv.fp8_gemv_pair(x, wa, sa, wb, sb, act_quant)
    assert both.shape == (2, 1, 256)
    assert torch.equal(both[0], fp8_gemv.fp8_gemv(x, wa, sa, act_quant))
    assert torch.equal(both[1], fp8_gemv.fp8_gemv(x, wb, sb, act_quant))
    # b before a in memory: a negative offset works the same
    assert torch.equal(fp8_gemv.fp8_gemv_pair(x, wb, sb, wa, sa, act_quant)[1], both[0])
    with pytest.raises(ValueError, match="differ in shape"):
        fp8_gemv.fp8_gemv_pair(x, wa, sa, wb[:128], sb[:1], act_quant)


class _Linear:
    """What fp8_block_linear_pair reads of an Fp8BlockLinear (weight, weight_scale, act_quant)."""

    def __init__(self, w, s, act_quant):
        self.weight, self.weight_scale, self.act_quant = w, s, act_quant

    def __call__(self, x):
        return Q.fp8_block_linear_ref(x, self.weight, self.weight_scale, self.act_quant)


def test_ops_pair_off_cuda_is_each_module():
    from dsv4_kernels import ops
    a, b = _Linear(*_weight(128, 256, "cpu"), True), _Linear(*_weight(128, 256, "cpu"), True)
    x = torch.randn(1, 256)
    ya, yb = ops.fp8_block_linear_pair(x, a, b)
    assert torch.equal(ya, a(x)) and torch.equal(yb, b(x))


def test_config_takes_the_measured_tiles_and_keeps_whole_blocks():
    from dsv4_kernels import fp8_gemv
    # the sweep's choices at Flash's shapes (N, K): wq_a, wo_b, wq_b, the shared expert's down
    picks = {(1024, 4096): (4, 4096), (4096, 8192): (8, 2048), (32768, 1024): (16, 1024), (4096, 2048): (8, 2048)}
    for (N, K), (bn, bk) in picks.items():
        cfg = fp8_gemv.gemv_config(1, N, K)
        assert (cfg["BLOCK_N"], cfg["BLOCK_K"]) == (bn, bk), (N, K, cfg)
    for K in (128, 256, 1280, 16384):
        cfg = fp8_gemv.gemv_config(1, 512, K)
        assert cfg["BLOCK_K"] % 128 == 0 and cfg["BLOCK_N"] * cfg["BLOCK_K"] <= 16384 and cfg["BLOCK_N"] >= 1


def test_bad_inputs_are_named(device):
    from dsv4_kernels import fp8_gemv
    w, s = _weight(128, 256, device)
    with pytest.raises(ValueError, match="1..4 rows"):
        fp8_gemv.fp8_gemv(torch.randn(5, 256, device=device), w, s, True)
    with pytest.raises(ValueError, match="K % 128"):
        fp8_gemv.fp8_gemv(torch.randn(1, 200, device=device), w[:, :200], s, True)
    with pytest.raises(ValueError, match="whole 128-row blocks per group"):
        fp8_gemv.fp8_grouped_gemv(torch.randn(1, 4, 256, device=device), w, s)


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(1024, 4096), (32768, 1024), (512, 4096), (4096, 8192), (4096, 2048)])
@pytest.mark.parametrize("M", [1, 2, 4])
def test_gpu_decode_linears_take_the_gemv_and_match_cublas(N, K, M):
    """At Flash's FP8 linear shapes, the GEMV agrees with cuBLAS's block-scaled GEMM and the
    reference; `auto` takes it for one row and the Triton GEMM for a few (bit-equal to calling
    them), and replays in a CUDA graph."""
    from dsv4_kernels import fp8_gemm, fp8_gemv
    q, s = Q.quantize_fp8_weight(torch.randn(N, K, device="cuda") / K ** 0.5)
    x = torch.randn(M, K, device="cuda").bfloat16()
    y = fp8_gemv.fp8_gemv(x, q, s, True)
    chosen = y if M == 1 else fp8_gemm.fp8_block_linear(x, q, s, True, backend="triton")
    assert torch.equal(fp8_gemm.fp8_block_linear(x, q, s, True), chosen)
    ref = Q.fp8_block_linear_ref(x.float(), q, s, True)
    torch.testing.assert_close(y.float(), ref, rtol=2 ** -8, atol=1e-3)
    cublas = fp8_gemm.fp8_block_linear(x, q, s, True, backend="cublas")
    torch.testing.assert_close(y.float(), cublas.float(), rtol=2 ** -7, atol=2e-3)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_gemv.fp8_gemv(x, q, s, True)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(out, fp8_gemv.fp8_gemv(x, q, s, True))


@pytest.mark.gpu
def test_gpu_shared_expert_pair_is_one_gemv_equal_to_two():
    """The shared expert's gate and up at Flash dims: one row takes the pair GEMV, bit-equal to
    the two linears' own GEMVs; two rows take the linears themselves."""
    from dsv4_kernels import fp8_gemm, ops
    mods = [_Linear(*Q.quantize_fp8_weight(torch.randn(2048, 4096, device="cuda") / 64), True) for _ in range(2)]
    for rows in (1, 2):
        x = torch.randn(rows, 4096, device="cuda").bfloat16()
        ya, yb = ops.fp8_block_linear_pair(x, *mods)
        for y, m in ((ya, mods[0]), (yb, mods[1])):
            if rows == 1:
                assert torch.equal(y, fp8_gemm.fp8_block_linear(x, m.weight, m.weight_scale, True))
            torch.testing.assert_close(y.float(), m(x.float()), rtol=2 ** -7, atol=2e-3)



def _swiglu_down_add_steps(gate, up, mod, limit, add):
    """The three launches fp8_gemv_swiglu_add replaces: activation, down linear, fp32 sum."""
    from dsv4_kernels import elementwise, fp8_gemv
    act = elementwise.swiglu_clamped(gate, up, limit, gate.dtype)
    y = fp8_gemv.fp8_gemv(act, mod.weight, mod.weight_scale, mod.act_quant)
    return elementwise.add_fp32(add, y, gate.dtype)


@pytest.mark.parametrize("limit,act_quant,dtype", [
    (7.0, True, torch.bfloat16),   # the release's clamped shared expert
    (0.0, True, torch.float32),    # no clamp
    (3.0, False, torch.float32),   # weight-only numerics
])
def test_swiglu_down_add_is_the_three_steps_in_one_launch(device, limit, act_quant, dtype):
    """Activation before the GEMV and the fp32 sum after it: the same bits as the activation
    kernel, the GEMV and the add kernel run one after another; gate and up may be the two
    halves of the pair GEMV's output, in either order."""
    require_triton()
    from dsv4_kernels import fp8_gemv, reference
    N, K = 200, 384
    mod = _Linear(*_weight(N, K, device), act_quant)
    pair = (torch.randn(2, 1, K) * 6).to(device=device, dtype=dtype)  # values beyond the limit too
    add = torch.randn(1, N, device=device) * 3
    for gate, up in ((pair[0], pair[1]), (pair[1], pair[0])):
        got = fp8_gemv.fp8_gemv_swiglu_add(gate, up, mod.weight, mod.weight_scale, act_quant, limit, add)
        assert got.shape == (1, N) and got.dtype == dtype
        assert torch.equal(got, _swiglu_down_add_steps(gate, up, mod, limit, add))
    if dtype == torch.float32:  # (in bf16 the interpreter truncates where the GPU rounds)
        ref = add + Q.fp8_block_linear_ref(reference.swiglu_clamped(pair[0], pair[1], limit), mod.weight,
                                           mod.weight_scale, act_quant)
        got = fp8_gemv.fp8_gemv_swiglu_add(pair[0], pair[1], mod.weight, mod.weight_scale, act_quant, limit, add)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="add"):
        fp8_gemv.fp8_gemv_swiglu_add(pair[0], pair[1], mod.weight, mod.weight_scale, act_quant, limit, add[:, :8])
    with pytest.raises(ValueError, match="differ in shape"):
        fp8_gemv.fp8_gemv_swiglu_add(pair[0], pair[1][:, :256], mod.weight, mod.weight_scale, act_quant, limit, add)


def _routed_rows(M, topk, N, num_experts, dtype, device):
    """The routed experts' rows before their sum, with one skipped assignment per row (an id
    outside [0, num_experts), its row NaN: never read) and the rest ordinary."""
    from dsv4_kernels.moe import RoutedRows
    partial = torch.randn(M * topk, N, device=device).to(dtype) * 2
    ids = torch.randint(0, num_experts, (M, topk), device=device, dtype=torch.int32)
    for r in range(M):
        k = r % topk
        ids[r, k] = -1 if r % 2 == 0 else num_experts + r
        partial[r * topk + k] = float("nan")
    return RoutedRows(partial, ids, num_experts)


@pytest.mark.parametrize("M,dtype,with_streams", [(1, torch.bfloat16, True), (3, torch.float32, False)])
def test_swiglu_down_add_sums_routed_rows_in_its_launch(device, M, dtype, with_streams):
    """Given the routed experts' rows before their top-k sum (RoutedRows), the launch sums each
    row's top-k rows itself, skipping ids outside the experts: the same bits as sum_topk's
    launch followed by the fused launch with that sum."""
    require_triton()
    from dsv4_kernels import fp8_gemv
    N, K, topk = 200, 384, 6
    mod = _Linear(*_weight(N, K, device), True)
    pair = (torch.randn(2, M, K) * 6).to(device=device, dtype=dtype)
    routed = _routed_rows(M, topk, N, 16, dtype, device)
    streams = tuple(t for t in _streams(M, 4, N, dtype, device)) if with_streams else None
    summed = routed.sum()
    assert summed.dtype == torch.float32 and torch.isfinite(summed).all()
    got = fp8_gemv.fp8_gemv_swiglu_add(pair[0], pair[1], mod.weight, mod.weight_scale, True, 7.0, routed,
                                       streams=streams)
    want = fp8_gemv.fp8_gemv_swiglu_add(pair[0], pair[1], mod.weight, mod.weight_scale, True, 7.0, summed,
                                        streams=streams)
    assert torch.equal(got, want)
    from dsv4_kernels.moe import RoutedRows
    with pytest.raises(ValueError, match="top-k"):
        fp8_gemv.fp8_gemv_swiglu_add(pair[0], pair[1], mod.weight, mod.weight_scale, True, 7.0,
                                     RoutedRows(routed.partial[:-1], routed.ids, 16))


def test_swiglu_linear_add_sums_routed_rows_first_where_the_gemv_does_not_take_them(device):
    """fp8_gemm's entry point off the one-row GEMV (here: not CUDA, or several rows) sums the
    routed rows with sum_topk first, then runs the separate steps: the result of the plain sum."""
    require_triton()
    from dsv4_kernels import fp8_gemm
    N, K = 128, 256
    mod = _Linear(*_weight(N, K, device), True)
    gate, up = torch.randn(2, K, device=device) * 4, torch.randn(2, K, device=device) * 4
    routed = _routed_rows(2, 4, N, 8, torch.float32, device)
    got = fp8_gemm.fp8_swiglu_linear_add(gate, up, mod, 5.0, routed)
    assert torch.equal(got, fp8_gemm.fp8_swiglu_linear_add(gate, up, mod, 5.0, routed.sum()))


def test_ops_swiglu_down_add_off_cuda_is_the_steps():
    """Off CUDA the op is the reference activation, the module and the fp32 sum."""
    from dsv4_kernels import ops, reference
    mod = _Linear(*_weight(128, 256, "cpu"), True)
    gate, up = torch.randn(2, 256) * 5, torch.randn(2, 256) * 5
    add = torch.randn(2, 128)
    got = ops.fp8_swiglu_linear_add(gate, up, mod, 4.0, add)
    want = add + mod(reference.swiglu_clamped(gate, up, 4.0))
    assert torch.equal(got, want)


@pytest.mark.gpu
def test_gpu_shared_expert_tail_is_one_launch_equal_to_three():
    """Flash's shared-expert down projection (2048 -> 4096) at one row: the fused launch gives
    the bits of the activation kernel, the GEMV and the add kernel, and replays in a graph."""
    from dsv4_kernels import ops
    mod = _Linear(*Q.quantize_fp8_weight(torch.randn(4096, 2048, device="cuda") / 45), True)
    pair = (torch.randn(2, 1, 2048, device="cuda") * 4).bfloat16()
    add = torch.randn(1, 4096, device="cuda")
    got = ops.fp8_swiglu_linear_add(pair[0], pair[1], mod, 10.0, add)
    assert torch.equal(got, _swiglu_down_add_steps(pair[0], pair[1], mod, 10.0, add))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.fp8_swiglu_linear_add(pair[0], pair[1], mod, 10.0, add)
    pair.copy_((torch.randn(2, 1, 2048, device="cuda") * 4).bfloat16())
    graph.replay()
    assert torch.equal(out, _swiglu_down_add_steps(pair[0], pair[1], mod, 10.0, add))


@pytest.mark.gpu
def test_gpu_shared_expert_tail_sums_the_routed_rows_at_flash_shapes():
    """Flash's decode MoE tail at one row: six routed rows of 4096 (bf16, humming's down output)
    summed inside the shared expert's down GEMV, with the mHC streams after it: the bits of
    sum_topk followed by the fused launch, and the same from a graph replay."""
    from dsv4_kernels import ops
    mod = _Linear(*Q.quantize_fp8_weight(torch.randn(4096, 2048, device="cuda") / 45), True)
    pair = (torch.randn(2, 1, 2048, device="cuda") * 4).bfloat16()
    routed = _routed_rows(1, 6, 4096, 256, torch.bfloat16, "cuda")
    streams = _streams(1, 4, 4096, torch.bfloat16, "cuda")
    want = ops.fp8_swiglu_linear_add(pair[0], pair[1], mod, 10.0, routed.sum(), streams)
    assert torch.equal(ops.fp8_swiglu_linear_add(pair[0], pair[1], mod, 10.0, routed, streams), want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.fp8_swiglu_linear_add(pair[0], pair[1], mod, 10.0, routed, streams)
    routed.partial.copy_(torch.randn_like(routed.partial))
    graph.replay()
    assert torch.equal(out, ops.fp8_swiglu_linear_add(pair[0], pair[1], mod, 10.0, routed.sum(), streams))


def _streams(M, hc, N, dtype, device):
    residual = torch.randn(M, hc, N, device=device).to(dtype)
    post = torch.rand(M, hc, device=device) * 2
    comb = torch.softmax(torch.randn(M, hc, hc, device=device), -1)
    return residual, post, comb


@pytest.mark.parametrize("M,dtype", [(1, torch.bfloat16), (3, torch.float32)])
def test_streams_epilogue_is_the_linear_then_hc_post(device, M, dtype):
    """HC: the GEMV writes the mHC streams after its output (hc_post of the output as stored),
    the same bits as the GEMV and the hc_post kernel one after another; with the shared
    expert's SWIGLU / ADD steps too."""
    require_triton()
    from dsv4_kernels import fp8_gemv, mhc
    N, K, hc = 256, 384, 4
    mod = _Linear(*_weight(N, K, device), True)
    x = torch.randn(M, K, device=device).to(dtype)
    streams = _streams(M, hc, N, dtype, device)
    got = fp8_gemv.fp8_gemv(x, mod.weight, mod.weight_scale, True, streams=streams)
    assert got.shape == (M, hc, N) and got.dtype == dtype
    assert torch.equal(got, mhc.hc_post(fp8_gemv.fp8_gemv(x, mod.weight, mod.weight_scale, True), *streams))
    pair = torch.randn(2, 1, K, device=device).to(dtype) * 4
    add = torch.randn(1, N, device=device)
    one = tuple(t[:1] for t in streams)
    got = fp8_gemv.fp8_gemv_swiglu_add(pair[0], pair[1], mod.weight, mod.weight_scale, True, 5.0, add, streams=one)
    assert torch.equal(got, mhc.hc_post(_swiglu_down_add_steps(pair[0], pair[1], mod, 5.0, add), *one))
    with pytest.raises(ValueError, match="streams"):
        fp8_gemv.fp8_gemv(x, mod.weight, mod.weight_scale, True, streams=(streams[0][:, :3], *streams[1:]))


def test_ops_streams_off_cuda_are_the_linear_then_hc_post():
    from dsv4_kernels import ops, reference
    mod = _Linear(*_weight(128, 256, "cpu"), True)
    x = torch.randn(1, 256)
    streams = _streams(1, 4, 128, torch.float32, "cpu")
    assert torch.equal(ops.fp8_linear_hc_post(x, mod, *streams), reference.hc_post(mod(x), *streams))
    gate, up, add = torch.randn(1, 256), torch.randn(1, 256), torch.randn(1, 128)
    assert torch.equal(ops.fp8_swiglu_linear_add(gate, up, mod, 3.0, add, streams),
                       reference.hc_post(ops.fp8_swiglu_linear_add(gate, up, mod, 3.0, add), *streams))


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(4096, 8192), (4096, 2048)])  # Flash's wo_b; the shared expert's down
def test_gpu_sublayer_last_linear_writes_the_streams(N, K):
    """At Flash's shapes, one row: the GEMV with the HC epilogue equals the GEMV then the
    hc_post kernel (bf16 streams, hc = 4), and replays in a graph."""
    from dsv4_kernels import mhc, ops
    mod = _Linear(*Q.quantize_fp8_weight(torch.randn(N, K, device="cuda") / K ** 0.5), True)
    x = torch.randn(1, K, device="cuda").bfloat16()
    streams = _streams(1, 4, N, torch.bfloat16, "cuda")
    want = mhc.hc_post(ops.fp8_block_linear(x, mod.weight, mod.weight_scale, True), *streams)
    torch.testing.assert_close(ops.fp8_linear_hc_post(x, mod, *streams), want, rtol=2 ** -8, atol=0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.fp8_linear_hc_post(x, mod, *streams)
    x.copy_(torch.randn_like(x))
    graph.replay()
    want = mhc.hc_post(ops.fp8_block_linear(x, mod.weight, mod.weight_scale, True), *streams)
    torch.testing.assert_close(out, want, rtol=2 ** -8, atol=0)
    print("max |diff| vs two launches:", (out.float() - want.float()).abs().max().item())


@pytest.mark.parametrize("M,K,dtype,block_k", [(1, 1024, torch.bfloat16, None), (2, 384, torch.float32, None),
                                               (1, 512, torch.float32, 256)])  # last: K over two slabs
def test_rms_prologue_is_the_norm_then_the_gemv(device, M, K, dtype, block_k):
    """RMS: the rows RMS-normalised with a weight inside the GEMV's launch, as the norm kernel
    writes them (rounded to x's dtype) and the GEMV then reads them."""
    require_triton()
    from dsv4_kernels import elementwise, fp8_gemv
    N = 256
    w, s = _weight(N, K, device)
    x = (torch.randn(M, K) * 3).to(device=device, dtype=dtype)
    norm_w = (torch.rand(K) + 0.5).to(device)
    cfg = None if block_k is None else dict(BLOCK_N=16, BLOCK_K=block_k, num_warps=4, num_stages=2)
    got = fp8_gemv.fp8_gemv(x, w, s, True, cfg, rms=(norm_w, 1e-6))
    want = fp8_gemv.fp8_gemv(elementwise.rms_norm(x, norm_w, 1e-6), w, s, True, cfg)
    if block_k is None:  # one slab: the norm's sum of squares in the norm kernel's order
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    ref = Q.fp8_block_linear_ref(elementwise.rms_norm(x, norm_w, 1e-6).float(), w, s, True)
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=5e-2)
    torch.testing.assert_close(got.float(), ref, **tol)
    with pytest.raises(ValueError, match="norm weight"):
        fp8_gemv.fp8_gemv(x, w, s, True, rms=(norm_w[:128], 1e-6))


def test_ops_rms_linear_off_cuda_is_the_norm_then_the_module():
    from dsv4_kernels import ops
    mod = _Linear(*_weight(128, 256, "cpu"), True)
    x, norm_w = torch.randn(1, 256), torch.rand(256) + 0.5
    assert not ops.rms_linear_fuses(x, mod)
    assert torch.equal(ops.fp8_rms_linear(x, norm_w, 1e-6, mod), mod(ops.rms_norm(x, norm_w, 1e-6)))


@pytest.mark.gpu
def test_gpu_q_norm_inside_wq_b():
    """Flash's wq_b (1024 -> 32768) at one row with q_norm in the prologue: the norm kernel then
    the GEMV, up to the order of the norm's sum of squares (the two launches reduce it in
    different layouts)."""
    from dsv4_kernels import elementwise, fp8_gemv
    w, s = Q.quantize_fp8_weight(torch.randn(32768, 1024, device="cuda") / 32)
    x = torch.randn(1, 1024, device="cuda").bfloat16()
    norm_w = torch.rand(1024, device="cuda") + 0.5
    got = fp8_gemv.fp8_gemv(x, w, s, True, rms=(norm_w, 1e-6))
    want = fp8_gemv.fp8_gemv(elementwise.rms_norm(x, norm_w, 1e-6), w, s, True)
    print("max |diff| vs two launches:", (got.float() - want.float()).abs().max().item())
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -6, atol=2e-2)
