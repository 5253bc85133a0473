"""Triton FP8 block-scaled linear (fp8_gemm.py) against quant_reference.

Tolerances: the activation quantizer is bit-exact (same integer formula). The GEMM's products
are exact (e4m3 x e4m3, or e4m3 x pow2 converted exactly), so the only difference from the
reference is the order of the fp32 sums: rtol 1e-5 on fp32 outputs, one bf16 ulp on bf16 ones
(compared with the reference's fp32 result, before its own rounding; 2^-7 relative because the
interpreter's fp32 -> bf16 cast truncates where the GPU rounds to nearest). bf16 x with act_quant is
the FP8 tensor-core kernel, whose in-block accumulation on a GPU is narrower than fp32
(assert_fp8_mma_close); fp32 x always takes the exact fp32 kernel (x rounded to FP8 values
first with act_quant). The interpreter's bf16 tl.dot is wrong, so weight-only bf16 (a bf16
dot) is checked on the GPU only; the FP8 kernel's dot is e4m3 and runs here. On an H200,
release numerics on bf16/fp16 x take cuBLAS by default (fp8_scaled_mm): the GPU tests run the
Triton kernel forced and auto, and the cuBLAS path at its edge shapes and under graph capture.
"""

import pytest
import torch

from dsv4_kernels import ops
from dsv4_kernels import quant_reference as Q
from kernel_test_utils import require_triton


def _weight(N, K, device):
    q, s = Q.quantize_fp8_weight(torch.randn(N, K) * torch.linspace(0.05, 2, K))
    return q.to(device), s.to(device)


def test_act_round_kernel_is_bit_exact(device):
    require_triton()
    from dsv4_kernels import fp8_act_quant
    x = torch.randn(3, 384) * torch.logspace(-6, 2, 384)
    x[0, 128:256] = 0
    assert torch.equal(fp8_act_quant.round_act(x.to(device)).cpu(), Q.fp8_round_blocks(x))


def test_act_quant_kernel_is_bit_exact(device):
    require_triton()
    from dsv4_kernels import fp8_act_quant
    # Blocks of very different magnitudes (incl. all-zero, tiny, subnormal-e4m3 values, exact
    # ties at the scale's grid and values that saturate the pow2 rounding).
    x = torch.randn(6, 512) * torch.logspace(-7, 3, 512)
    x[1, :128] = 0
    x[2, 128:256] = torch.arange(128) * 2.0 ** -9 + 2.0 ** -10  # midpoints of the subnormals
    x[3, :128] = 448.0 * torch.linspace(-1, 1, 128)
    q, s = fp8_act_quant.quantize_act(x.to(device))
    q_ref, s_ref = Q.quantize_fp8_blocks(x)
    assert torch.equal(s.cpu(), s_ref)
    assert torch.equal(q.view(torch.uint8).cpu(), q_ref.view(torch.uint8))


@pytest.mark.parametrize("M", [5, 37, 70])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_act_quant_is_bit_exact_on_16bit_gemm_inputs(device, M, dtype):
    # The FP8 GEMM's own activation rounding at the GEMM test's shapes, apart from its
    # accumulation: bf16 / fp16 x upcast to fp32 exactly, then the reference's rule.
    require_triton()
    from dsv4_kernels import fp8_gemm
    x = torch.randn(M, 256, device=device).to(dtype)
    q, s = fp8_gemm.quantize_act(x)
    q_ref, s_ref = Q.quantize_fp8_blocks(x.float().cpu())
    assert torch.equal(s.cpu(), s_ref)
    assert torch.equal(q.view(torch.uint8).cpu(), q_ref.view(torch.uint8))


@pytest.mark.parametrize("M,N,K,act_quant,dtype", [
    (1, 200, 384, True, torch.bfloat16),    # FP8 kernel: one token, N not a multiple of 64
    (37, 130, 256, True, torch.bfloat16),   # M between tiles, ragged last weight block
    (70, 64, 256, True, torch.bfloat16),    # M > 64: activations quantized by their own kernel
    (5, 130, 256, True, torch.float32),     # exact path: rounded x, fp32 GEMM
    (1, 96, 200, False, torch.float32),     # weight-only, K not a multiple of the K tile
    (19, 256, 320, False, torch.float32),
])
def test_fp8_block_linear_matches_reference(device, M, N, K, act_quant, dtype):
    require_triton()
    from dsv4_kernels import fp8_gemm
    w, s = _weight(N, K, device)
    x = torch.randn(M, K, device=device).to(dtype)
    y = fp8_gemm.fp8_block_linear(x, w, s, act_quant)
    ref = Q.fp8_block_linear_ref(x.float(), w, s, act_quant)
    assert y.shape == (M, N) and y.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-4)
    else:
        assert_fp8_mma_close(y, ref, x, w, s)


def assert_fp8_mma_close(y, ref, x, w, s):
    """bf16/fp16 x with act_quant: the FP8 tensor-core kernel. Its activations are the
    reference's bit for bit (test_act_quant_kernel_is_bit_exact, also compiled on the GPU), but
    Hopper's FP8 MMA keeps about 14 significant bits while it accumulates a 128-deep block
    (DeepSeek-V3's report on the H800; the release's GEMMs promote to fp32 per 128 as this
    kernel does): a block's sum is off by up to ~2^-13 of its largest partial sums. So each
    element is held to 2^-11 of the sum of its |products| (8-16x that size), plus one output
    rounding (2^-7: the interpreter's bf16 cast truncates). Outputs near zero after cancellation
    are held by the first term alone: on an H200 (37 x 130 and 70 x 64, K = 256) some were 5.6e-3
    off, where |products| sum to ~170 on average. A wrong scale or block is off by O(|products|)."""
    xq = Q.fp8_round_blocks(x.float().cpu())
    abs_products = xq.abs() @ Q.dequantize_fp8_block(w.cpu(), s.cpu()).abs().t()
    err = (y.float().cpu() - ref.cpu()).abs()
    bound = 2 ** -11 * abs_products + 2 ** -7 * ref.cpu().abs() + 1e-4
    assert (err <= bound).all(), f"{int((err > bound).sum())} elements beyond the bound, worst " \
        f"{(err / bound).max().item():.2f}x"


@pytest.mark.parametrize("act_quant", [True, False])
def test_split_k_sums_the_same_products(device, act_quant):
    require_triton()
    from dsv4_kernels import fp8_gemm
    M, N, K = 3, 64, 1024
    w, s = _weight(N, K, device)
    # Leading dims are flattened and restored; bf16 x with act_quant: the FP8 kernel.
    x = torch.randn(2, M, K, device=device).to(torch.bfloat16 if act_quant else torch.float32)
    base = fp8_gemm.gemm_config(2 * M, N, K, act_quant)
    assert base["split"] > 1  # small M: K is split to keep the SMs streaming
    one = dict(base, split=1, steps_per_split=K, fuse_quant=False)  # one program, all of K
    y_split = fp8_gemm.fp8_block_linear(x, w, s, act_quant, config=base)
    y_one = fp8_gemm.fp8_block_linear(x, w, s, act_quant, config=one)
    assert y_split.shape == (2, M, N)
    tol = dict(rtol=2 ** -7, atol=1e-4) if act_quant else dict(rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(y_split.float(), y_one.float(), **tol)
    torch.testing.assert_close(y_split.float(), Q.fp8_block_linear_ref(x.float(), w, s, act_quant),
                               **tol)


@pytest.mark.parametrize("T,K,split", [
    (1, 1024, True),   # decode: K split across programs, one sum over every group
    (19, 200, False),  # K not a multiple of the K tile, one split
])
def test_grouped_weight_only_is_each_group_through_its_rows(device, T, K, split):
    require_triton()
    from dsv4_kernels import fp8_gemm
    G, n = 3, 128
    w, s = _weight(G * n, K, device)
    s[n // 128:2 * n // 128] *= 4.0  # the groups' scales differ
    x = torch.randn(T, G, K, device=device)
    assert (fp8_gemm.gemm_config(T, G * n, K, False)["split"] > 1) == split
    y = fp8_gemm.fp8_grouped_linear(x, w, s)
    assert y.shape == (T, G, n) and y.dtype == x.dtype
    for g in range(G):  # the plain weight-only GEMM on the group's rows, and the reference
        rows, srows = slice(g * n, (g + 1) * n), slice(g * n // 128, (g + 1) * n // 128)
        want = Q.fp8_block_linear_ref(x[:, g], w[rows], s[srows], False)
        torch.testing.assert_close(y[:, g], want, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(y[:, g], fp8_gemm.fp8_block_linear(x[:, g], w[rows], s[srows], False),
                                   rtol=1e-5, atol=1e-4)
    # a strided x (every other group of a wider tensor) is read in place
    wide = torch.randn(T, 2 * G, K, device=device)
    torch.testing.assert_close(fp8_gemm.fp8_grouped_linear(wide[:, ::2], w, s),
                               fp8_gemm.fp8_grouped_linear(wide[:, ::2].contiguous(), w, s))
    with pytest.raises(ValueError, match="whole 128-row blocks per group"):
        fp8_gemm.fp8_grouped_linear(torch.randn(T, 2 * G, K // 2, device=device), w[:, :K // 2], s)
    with pytest.raises(ValueError, match="whole 128-row blocks per group"):
        fp8_gemm.fp8_grouped_linear(torch.randn(T, 2 * G, K, device=device), w, s)


def test_ops_grouped_linear_off_cuda_is_the_reference_per_group():
    G, n, K, T = 2, 128, 256, 4
    w, s = _weight(G * n, K, "cpu")
    x = torch.randn(T, G, K)
    got = ops.fp8_grouped_linear(x, w, s)
    for g in range(G):
        want = Q.fp8_block_linear_ref(x[:, g], w[g * n:(g + 1) * n], s[g:g + 1], False)
        assert torch.equal(got[:, g], want)


@pytest.mark.parametrize("N,K", [(256, 384), (200, 136)])  # whole blocks; ragged last blocks
@pytest.mark.parametrize("pow2", [True, False])
def test_dequantize_weight_is_the_reference(device, N, K, pow2):
    require_triton()
    from dsv4_kernels import fp8_gemm

    g = torch.Generator().manual_seed(N + K)
    w, s = Q.quantize_fp8_weight(torch.randn(N, K, generator=g) * 0.05)
    if not pow2:  # scales a bf16 multiply must round (a checkpoint outside the release's ue8m0)
        s = s * (1 + torch.rand(s.shape, generator=g) * 0.3)
    w, s = w.to(device), s.to(device)
    for dtype in (torch.float32, torch.bfloat16):
        got = fp8_gemm.dequantize_weight(w, s, dtype)
        want = Q.dequantize_fp8_block(w, s, dtype)
        assert got.dtype == dtype and got.shape == (N, K)
        if dtype == torch.bfloat16 and not pow2 and device == "cpu":
            # the interpreter's fp32 -> bf16 conversion truncates (the scale, then the
            # product): within two bf16 steps
            torch.testing.assert_close(got, want, rtol=2 ** -6, atol=0)
        else:
            assert torch.equal(got, want)  # one product, rounded once, as torch's chain
    with pytest.raises(ValueError, match="scales"):
        fp8_gemm.dequantize_weight(w, s[:1], torch.bfloat16)


def test_config_table_by_m():
    require_triton()
    from dsv4_kernels import fp8_gemm
    small = fp8_gemm.gemm_config(16, 1024, 4096, True)
    large = fp8_gemm.gemm_config(8192, 4096, 8192, True)
    assert (small["BLOCK_M"], small["BLOCK_K"]) == (16, 128) and small["split"] > 1
    assert small["fuse_quant"] and not large["fuse_quant"]
    assert (large["BLOCK_M"], large["BLOCK_N"], large["num_warps"], large["split"]) == (64, 128, 4, 1)
    wo = fp8_gemm.gemm_config(8192, 4096, 8192, False)
    assert (wo["BLOCK_M"], wo["BLOCK_N"], wo["BLOCK_K"]) == (128, 128, 64)
    for cfg, K in ((small, 4096), (large, 8192), (wo, 8192)):  # every split has K steps
        steps = K // cfg["BLOCK_K"]
        assert (cfg["split"] - 1) * cfg["steps_per_split"] < steps <= cfg["split"] * cfg["steps_per_split"]


def test_bad_inputs_are_named(device):
    require_triton()
    from dsv4_kernels import fp8_gemm
    w, s = _weight(64, 200, device)
    with pytest.raises(ValueError, match="act_quant needs K % 128 == 0"):
        fp8_gemm.fp8_block_linear(torch.randn(2, 200, device=device), w, s, True)
    with pytest.raises(ValueError, match="weight_scale"):
        fp8_gemm.fp8_block_linear(torch.randn(2, 200, device=device), w, s[:, :1], False)
    with pytest.raises(ValueError, match="K=100"):
        fp8_gemm.fp8_block_linear(torch.randn(2, 100, device=device), w, s, False)


# ---------------------------------------------------------------------------------------
# Compiled on an H200 at the release's shapes
# ---------------------------------------------------------------------------------------
FLASH = [(4096, 1024), (1024, 32768), (4096, 512), (8192, 4096), (4096, 2048), (2048, 4096)]
# Every Flash shape at M = 16 (split-K, quantization fused) and 64 (split-K, x quantized by its
# own kernel), and each other tile of gemm_config once: M = 1, 200 (64 x 128) and 2048
# (128 x 128, no split) on a shape each.
GPU_CASES = ([(K, N, M) for K, N in FLASH for M in (16, 64)]
             + [(4096, 1024, 1), (4096, 2048, 200), (8192, 4096, 2048)])


@pytest.mark.gpu
@pytest.mark.parametrize("K,N,M", GPU_CASES)
@pytest.mark.parametrize("act_quant,backend", [(True, "triton"), (True, "auto"), (False, "auto")])
def test_gpu_bf16_fp8_linear_at_flash_shapes(K, N, M, act_quant, backend):
    # Release numerics twice: the Triton kernel forced, and auto (cuBLAS on an H200).
    q, s = Q.quantize_fp8_weight(torch.randn(N, K, device="cuda") / K ** 0.5)
    x = torch.randn(M, K, device="cuda").bfloat16()
    y = ops.fp8_block_linear(x, q, s, act_quant, backend=backend)
    # The reference in fp32 (its own output rounded to bf16 would hide a 1-ulp sum difference).
    ref = Q.fp8_block_linear_ref(x.float(), q, s, act_quant)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), ref, rtol=2 ** -8, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("act_quant,backend", [(True, "triton"), (False, "triton"), (True, "auto")])
def test_gpu_fp8_linear_replays_in_a_cuda_graph(act_quant, backend):
    q, s = Q.quantize_fp8_weight(torch.randn(1024, 4096, device="cuda") / 64)
    x = torch.randn(16, 4096, device="cuda").bfloat16()
    out = ops.fp8_block_linear(x, q, s, act_quant, backend=backend)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.fp8_block_linear(x, q, s, act_quant, backend=backend)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, ops.fp8_block_linear(x, q, s, act_quant, backend=backend),
                               rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 64, 512])
def test_gpu_grouped_weight_only_at_wo_a_shapes_replays(T):
    """wo_a at Flash dims (8 groups of 1024 rows, K = 4096, bf16 x): one launch equals the
    per-group weight-only GEMMs up to summation order, and replays in a CUDA graph."""
    from dsv4_kernels import fp8_gemm
    G, n, K = 8, 1024, 4096
    q, s = Q.quantize_fp8_weight(torch.randn(G * n, K, device="cuda") / K ** 0.5)
    x = torch.randn(T, G, K, device="cuda").bfloat16()
    y = fp8_gemm.fp8_grouped_linear(x, q, s)
    for g in range(G):
        want = fp8_gemm.fp8_block_linear(x[:, g], q[g * n:(g + 1) * n], s[g * 8:(g + 1) * 8], False)
        torch.testing.assert_close(y[:, g].float(), want.float(), rtol=2 ** -7, atol=1e-3)
    static_x = x.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = fp8_gemm.fp8_grouped_linear(static_x, q, s)
    static_x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(static_y, fp8_gemm.fp8_grouped_linear(static_x, q, s))


# ---------------------------------------------------------------------------------------
# cuBLAS block scaling (fp8_scaled_mm) on an H200
# ---------------------------------------------------------------------------------------
# (M, N, K): K/128 = 4 / 8 / 32 / 64 (scales as they are), 3 / 5 (zero-padded to 8 blocks:
# the explicit-recipe API), 1 with N/128 = 1 (size-1 scale dims); M = 1 and M % 4 != 0 (rows
# padded and sliced), decode and prefill sizes.
CUBLAS_CASES = [(1, 1024, 4096), (5, 256, 384), (7, 512, 640), (3, 128, 128), (16, 2048, 512),
                (64, 32768, 1024), (200, 4096, 2048), (2048, 4096, 8192)]


def _require_sm90():
    if torch.cuda.get_device_capability() != (9, 0):  # cuBLAS's DeepSeek scaling is Hopper's
        pytest.skip("cuBLAS 1x128 x 128x128 block scaling runs on sm90 only")


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", CUBLAS_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_cublas_block_linear_matches_reference(M, N, K, dtype):
    from dsv4_kernels import fp8_scaled_mm as S
    _require_sm90()
    q, s = Q.quantize_fp8_weight(torch.randn(N, K, device="cuda") / K ** 0.5)
    x = torch.randn(M, K, device="cuda").to(dtype)
    padded = (K // 128) % 4 != 0
    ref = Q.fp8_block_linear_ref(x.float(), q, s, True)
    if S.device_supports(x.device, dtype, padded):
        assert S.use_cublas(x, q, True, "auto")  # what the model's linears take
        y = ops.fp8_block_linear(x, q, s, True, backend="cublas")
    else:
        # torch._scaled_mm's layout is what the H200 ran (probe_torch_gemm.py); only the
        # zero-padded one (torch.nn.functional.scaled_mm) may be missing from this torch.
        assert padded, S.probe_failures()
        with pytest.raises(ValueError, match="failed the cuBLAS block-scaling probe"):
            ops.fp8_block_linear(x, q, s, True, backend="cublas")
        y = ops.fp8_block_linear(x, q, s, True)  # auto falls back to Triton
        print(f"padded layout unsupported here, Triton ran: {S.probe_failures()}")
    assert y.shape == (M, N) and y.dtype == dtype
    torch.testing.assert_close(y.float(), ref, rtol=2 ** -8, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("M,K", [(5, 384), (1, 4096), (64, 1024)])
def test_gpu_cublas_block_linear_replays_in_a_cuda_graph(M, K):
    from dsv4_kernels import fp8_scaled_mm as S
    _require_sm90()
    N = 1024
    q, s = Q.quantize_fp8_weight(torch.randn(N, K, device="cuda") / K ** 0.5)
    x = torch.randn(M, K, device="cuda").bfloat16()
    if not S.device_supports(x.device, x.dtype, (K // 128) % 4 != 0):
        assert (K // 128) % 4, S.probe_failures()
        pytest.skip(f"padded scale layout unsupported by this torch: {S.probe_failures()}")
    layout = S.weight_scale_layout(s)  # built once, outside the capture, as Fp8BlockLinear does
    eager = ops.fp8_block_linear(x, q, s, True, backend="cublas", cublas_scale=layout)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.fp8_block_linear(x, q, s, True, backend="cublas", cublas_scale=layout)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, ops.fp8_block_linear(x, q, s, True, backend="cublas",
                                                         cublas_scale=layout), rtol=0, atol=0)
    torch.testing.assert_close(out.float(), Q.fp8_block_linear_ref(x.float(), q, s, True),
                               rtol=2 ** -8, atol=1e-3)
