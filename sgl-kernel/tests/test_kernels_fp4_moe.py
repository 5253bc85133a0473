"""Triton FP4 MoE (fp4_moe.py: the bf16 and gemv variants) against quant_reference.fp4_moe_ref.

Tolerance: the decoded weights and (act_quant) the FP8-rounded activations are exact in every
variant, so only the fp32 summation order differs from the reference (rtol 1e-5 under the
interpreter). One caveat makes act_quant fragile in principle: the down GEMM's input is rounded
to FP8 after an fp32 sum, so a sum that lands differently by one ulp right at a rounding
midpoint flips one code; random data does not hit that at these sizes. bf16 runs on the GPU
only (the interpreter's bf16 tl.dot is wrong). On a GPU (assert_matches_reference) the fp32 dots
sum in another order (6e-5 relative seen on one element: 1e-4).
"""

import pytest
import torch

from dsv4_kernels import ops
from dsv4_kernels import quant_reference as Q
from kernel_test_utils import distinct_expert_ids, fp4_experts, require_triton


def assert_matches_reference(out, ref, device):
    if device == "cpu":
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


CASES = [  # (variant, act_quant)
    ("bf16", False), ("bf16", True)]


@pytest.mark.parametrize("variant,act_quant", CASES)
@pytest.mark.parametrize("T", [1, 7])
def test_fp4_moe_matches_reference_on_an_expert_shard(device, variant, act_quant, T):
    require_triton()
    from dsv4_kernels import fp4_moe
    E, d, inter, topk = 4, 128, 128, 3
    ws = fp4_experts(E, d, inter, device)
    x = torch.randn(T, d, device=device)
    # ids in [-1, E + 3): about half the assignments belong to another shard or are -1.
    ids = distinct_expert_ids(T, topk, -1, E + 3, device)
    weights = torch.rand(T, topk, device=device)
    out = torch.full((T, d), float("nan"), device=device)
    res = fp4_moe.fp4_fused_moe(x, *ws, ids, weights, 1.5, out, act_quant, variant)
    ref = Q.fp4_moe_ref(x, *ws, ids, weights, 1.5, act_quant)
    assert res is out
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant,act_quant", CASES)
def test_skipped_rows_are_zero_and_weights_scale_before_w2(device, variant, act_quant):
    require_triton()
    from dsv4_kernels import fp4_moe
    E, d, inter = 2, 128, 128
    ws = fp4_experts(E, d, inter, device)
    x = torch.randn(3, d, device=device) * 4
    # Row 0: nothing local. Row 1: expert 1 twice, the duplicate marked -1 by the caller.
    # Row 2: both experts, no SwiGLU clamp.
    ids = torch.tensor([[-1, 9], [1, -1], [0, 1]], dtype=torch.int32, device=device)
    weights = torch.tensor([[0.3, 0.7], [2.5, 2.5], [0.25, 0.5]], device=device)
    out = fp4_moe.fp4_fused_moe(x, *ws, ids, weights, 0.0, torch.empty(3, d, device=device),
                                act_quant, variant)
    assert out[0].eq(0).all()
    assert_matches_reference(out, Q.fp4_moe_ref(x, *ws, ids, weights, 0.0, act_quant), device)


@pytest.mark.parametrize("table_T,act_quant", [
    (64, False),    # 16-row, 64-wide tiles
    (1024, True),   # 32-row tiles, 4 warps
    (2048, True),   # 64-row tiles, 4 warps
    (8192, True),   # 128-row tiles (fp32 x: gate/up 64 wide), h rounded by its own kernel
])
# the bf16 decode: one dot per 32-input chunk, or per 128-input step (step_dot) with the pair
# decode (the default) or _e2m1_scaled's
@pytest.mark.parametrize("step_dot,pair_decode", [(False, False), (True, True), (True, False)])
def test_every_config_of_the_table_matches_the_reference(device, table_T, act_quant, step_dot,
                                                         pair_decode):
    require_triton()
    from dsv4_kernels import fp4_moe
    E, d, inter, T, topk = 3, 128, 256, 5, 2
    cfg = dict(fp4_moe.moe_config(table_T, 6, torch.float32), step_dot=step_dot,
               pair_decode=pair_decode)
    ws = fp4_experts(E, d, inter, device)
    x = torch.randn(T, d, device=device)
    ids = distinct_expert_ids(T, topk, -1, E + 1, device)
    weights = torch.rand(T, topk, device=device)
    out = fp4_moe.fp4_fused_moe(x, *ws, ids, weights, 2.0, torch.empty(T, d, device=device),
                                act_quant, "bf16", config=cfg)
    assert_matches_reference(out, Q.fp4_moe_ref(x, *ws, ids, weights, 2.0, act_quant), device)


def test_default_variant_follows_the_batch():
    require_triton()
    from dsv4_kernels import fp4_moe
    # gemv up to T = 16 at top-6 (96 assignments), the bf16 decode with one dot per step
    # beyond (each measured faster there on an H200); the switch
    # counts assignments, so top-8 moves it.
    assert [fp4_moe.default_variant(T, 6) for T in (1, 16, 17, 64, 1366, 8192)] == \
        ["gemv", "gemv", "bf16", "bf16", "bf16", "bf16"]
    assert [fp4_moe.default_variant(T, 8) for T in (12, 13)] == ["gemv", "bf16"]
    # the one-dot step from 97 assignments (measured from 384 up); the 2-warp 16 x 16 tiles
    # of the smallest batches (weight-only and fp32 calls alone run them) keep per-chunk dots
    assert all(fp4_moe.moe_config(T, 6)["step_dot"] for T in (17, 64, 1365, 1366))
    assert not fp4_moe.moe_config(16, 6).get("step_dot")
    assert fp4_moe.moe_config(1, 6)["block_n_up"] < fp4_moe.moe_config(8192, 6)["block_n_up"]
    assert fp4_moe.moe_config(8192, 6)["block_m"] == 128
    # fp32 activations keep the narrower 128-row tiles (the wide ones exceed sm_90's shared memory)
    assert fp4_moe.moe_config(8192, 6, torch.float32)["block_n_up"] == 64
    # rows per tile follow rows per expert (~ M / 256): 16 up to 3072 assignments, then 32 up
    # to 8192, 64 up to 16384, then 128 (as sweep_moe_tiles.py measured them on an H200)
    assert [fp4_moe.moe_config(T, 6)["block_m"] for T in (17, 512, 513, 1365, 1366, 2730, 2731)] == \
        [16, 16, 32, 32, 64, 64, 128]
    assert fp4_moe.moe_config(2048, 6, torch.float32)["block_m"] == 64
    # the tiers are data (configs/fp4_moe_tiles.json): bounded, increasing, the last unbounded
    bounds = [b for b, _, _ in fp4_moe._tile_tiers()]
    assert bounds[-1] is None and bounds[:-1] == sorted(bounds[:-1])


@pytest.mark.parametrize("step_dot", [False, True])
def test_weight_only_takes_dims_that_are_not_whole_tiles(device, step_dot):
    require_triton()
    from dsv4_kernels import fp4_moe
    E, d, inter, T = 3, 96, 160, 4  # 32-multiples: partial K and N tiles in both GEMMs
    ws = fp4_experts(E, d, inter, device)
    x = torch.randn(T, d, device=device)
    ids = distinct_expert_ids(T, 2, -1, E + 1, device)
    weights = torch.rand(T, 2, device=device)
    # step_dot with one 32-input chunk per step (96 and 160 take no wider step)
    cfg = dict(fp4_moe.moe_config(T, 2), step_dot=True) if step_dot else None
    out = fp4_moe.fp4_fused_moe(x, *ws, ids, weights, 1.0, torch.empty(T, d, device=device),
                                False, "bf16", config=cfg)
    torch.testing.assert_close(out, Q.fp4_moe_ref(x, *ws, ids, weights, 1.0, False),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="multiples of 128 with act_quant"):
        fp4_moe.fp4_fused_moe(x, *ws, ids, weights, 1.0, out, True, "bf16")


def test_shapes_and_variant_names_are_checked(device):
    require_triton()
    from dsv4_kernels import fp4_moe
    ws = fp4_experts(2, 128, 128, device)
    x = torch.randn(1, 128, device=device)
    ids = torch.zeros(1, 1, dtype=torch.int32, device=device)
    w = torch.ones(1, 1, device=device)
    out = torch.empty(1, 128, device=device)
    with pytest.raises(ValueError, match="w2_scale"):
        fp4_moe.fp4_fused_moe(x, *ws[:5], ws[5][:, :, :2], ids, w, 0.0, out, True)
    for name in ("int4", "fp8", "grouped"):  # only the variants that were fastest somewhere
        with pytest.raises(ValueError, match="variant must be one of"):
            fp4_moe.fp4_fused_moe(x, *ws, ids, w, 0.0, out, True, name)


# ---------------------------------------------------------------------------------------
# The gemv variant (decode-sized batches): block_m 1, 2 and 4 rows per expert block
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("act_quant", [False, True])
@pytest.mark.parametrize("block_m", [1, 2, 4])
def test_gemv_variant_matches_reference_at_each_block_m(device, block_m, act_quant):
    require_triton()
    from dsv4_kernels import fp4_gemv_moe, fp4_moe
    E, d, inter, T, topk = 4, 128, 256, 6, 3
    torch.manual_seed(block_m)
    ws = fp4_experts(E, d, inter, device)
    x = torch.randn(T, d, device=device)
    # ids in [-1, E + 2): a third of them skipped (-1 or another shard's), so expert blocks
    # hold 1-4 real rows and padding rows at every block_m.
    ids = distinct_expert_ids(T, topk, -1, E + 2, device)
    weights = torch.rand(T, topk, device=device)
    # Wider N tiles than the default (fewer programs under the interpreter), K steps of 64
    # inputs (2 and 4 steps: the prefetch of the next step's bytes).
    cfg = dict(fp4_gemv_moe.gemv_config(T, topk), block_m=block_m, block_n_up=64, block_n_down=64,
               chunks=2)
    out = torch.full((T, d), float("nan"), device=device)
    res = fp4_moe.fp4_fused_moe(x, *ws, ids, weights, 1.5, out, act_quant, "gemv", config=cfg)
    assert res is out
    torch.testing.assert_close(out, Q.fp4_moe_ref(x, *ws, ids, weights, 1.5, act_quant),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("act_quant", [False, True])
def test_gemv_variant_at_one_token_with_its_default_tiles(device, act_quant):
    require_triton()
    from dsv4_kernels import fp4_moe
    E, d, inter, topk = 8, 256, 128, 6  # K steps of 256 (gate/up) and 128 (down) inputs
    ws = fp4_experts(E, d, inter, device)
    x = torch.randn(1, d, device=device) * 3
    ids = torch.tensor([[5, 0, 11, 7, -1, 2]], dtype=torch.int32, device=device)
    weights = torch.rand(1, topk, device=device)
    out = fp4_moe.fp4_fused_moe(x, *ws, ids, weights, 2.0, torch.empty(1, d, device=device),
                                act_quant, "gemv")
    torch.testing.assert_close(out, Q.fp4_moe_ref(x, *ws, ids, weights, 2.0, act_quant),
                               rtol=1e-5, atol=1e-5)


def test_gemv_duplicate_experts_in_a_row_add_up_without_swiglu_limit(device):
    require_triton()
    from dsv4_kernels import fp4_gemv_moe, fp4_moe
    E, d, inter = 3, 128, 128
    ws = fp4_experts(E, d, inter, device)
    x = torch.randn(3, d, device=device) * 4
    # Row 0: expert 1 three times (three rows of one block, same token); row 1: nothing local;
    # row 2: experts 2 and 0 once each. Weight-only fp32: h is not rounded, so the duplicates'
    # sum equals the reference's one pass with their summed weight.
    ids = torch.tensor([[1, 1, 1], [-1, 3, 7], [2, 0, -1]], dtype=torch.int32, device=device)
    weights = torch.tensor([[0.5, 0.25, 2.0], [1.0, 1.0, 1.0], [0.75, 1.5, 9.0]],
                           device=device)
    cfg = dict(fp4_gemv_moe.gemv_config(64, 6), block_m=4)  # the larger-batch tiles
    out = fp4_moe.fp4_fused_moe(x, *ws, ids, weights, 0.0, torch.empty(3, d, device=device),
                                False, "gemv", config=cfg)
    assert out[1].eq(0).all()
    torch.testing.assert_close(out, Q.fp4_moe_ref(x, *ws, ids, weights, 0.0, False),
                               rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="block_m 1, 2 or 4"):
        fp4_moe.fp4_fused_moe(x, *ws, ids, weights, 0.0, out, False, "gemv",
                              config=dict(cfg, block_m=3))


def test_gemv_is_picked_only_below_its_switch(device, monkeypatch):
    require_triton()
    from dsv4_kernels import fp4_gemv_moe, fp4_moe
    # Release numerics on bf16/fp16 activations take gemv up to its switch; fp32 and
    # weight-only calls keep the bf16 decode.
    bf16, fp32 = torch.bfloat16, torch.float32
    assert [fp4_moe.select_variant(T, 6, True, bf16) for T in (1, 16, 17)] == ["gemv", "gemv", "bf16"]
    assert [fp4_moe.select_variant(1, 6, q, dt) for q, dt in ((False, bf16), (True, fp32), (False, fp32))] == \
        ["bf16"] * 3
    monkeypatch.setattr(fp4_moe, "GEMV_MAX_ASSIGNMENTS", 0)
    assert fp4_moe.select_variant(1, 6, True, bf16) == "bf16"
    # the tiles measured fastest on an H200 at T = 1, 16, 64 (configs/fp4_gemv_moe_tiles.json)
    assert [fp4_gemv_moe.gemv_config(T, 6)["block_m"] for T in (1, 16, 17, 64, 65)] == [1, 1, 2, 2, 4]
    assert [fp4_gemv_moe.gemv_config(T, 6)["block_n_up"] for T in (5, 6, 16, 17, 64, 65)] == [16, 64, 64, 16, 16, 64]
    # the wiring: a weight-only fp32 call with variant=None does not reach the gemv kernels,
    # and variant="gemv" does
    monkeypatch.setattr(fp4_moe, "GEMV_MAX_ASSIGNMENTS", 16 * 6)
    calls = []
    real = fp4_gemv_moe.gemv_moe
    monkeypatch.setattr(fp4_gemv_moe, "gemv_moe", lambda *a: calls.append(a[-1]) or real(*a))
    ws = fp4_experts(2, 128, 128, device)
    x = torch.randn(2, 128, device=device)
    ids = torch.tensor([[0, 5], [1, 0]], dtype=torch.int32, device=device)
    weights = torch.rand(2, 2, device=device)
    want = Q.fp4_moe_ref(x, *ws, ids, weights, 1.0, False)
    out = fp4_moe.fp4_fused_moe(x, *ws, ids, weights, 1.0, torch.empty(2, 128, device=device), False)
    assert calls == []
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    out = fp4_moe.fp4_fused_moe(x, *ws, ids, weights, 1.0, torch.empty(2, 128, device=device), False,
                                variant="gemv")
    assert [c["block_m"] for c in calls] == [1]
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------
# Compiled on an H200: Flash's expert dims, a shard, bf16 activations, graphs
# ---------------------------------------------------------------------------------------
@pytest.mark.gpu
# bf16: the pair decode with one dot per step from T = 17 (moe_config); bf16_bits: the step's
# decode by _e2m1_scaled instead
@pytest.mark.parametrize("variant,act_quant", CASES + [("bf16_bits", True)])
@pytest.mark.parametrize("T", [1, 64, 1500])  # moe_config's small, mid and 128-row tiles
def test_gpu_bf16_fp4_moe_at_flash_dims(flash_experts, variant, act_quant, T):
    ws, E, d, topk = flash_experts, 8, 4096, 6
    x = torch.randn(T, d, device="cuda").bfloat16()
    ids = distinct_expert_ids(T, topk, 0, 2 * E, "cuda")  # half of them on the other shard
    weights = torch.rand(T, topk, device="cuda")
    out = torch.empty(T, d, device="cuda")
    from dsv4_kernels import fp4_moe
    cfg = dict(fp4_moe.moe_config(T, topk), step_dot=True, pair_decode=False) \
        if variant == "bf16_bits" else None
    ops_out = fp4_moe.fp4_fused_moe(x, *ws, ids, weights, 10.0, out, act_quant, variant.split("_")[0],
                                    config=cfg)
    # The reference on up to 64 rows spread over the batch (tokens are independent).
    rows = torch.linspace(0, T - 1, min(T, 64), device="cuda").long().unique()
    ops_out = ops_out[rows]
    ref = Q.fp4_moe_ref(x[rows], *ws, ids[rows], weights[rows], 10.0, act_quant)
    # Weight-only: the reference rounds h to bf16 the same way, so only fp32 summation order
    # (and a rare bf16 flip of h) is left. act_quant: h is also rounded to FP8 (steps of 2^-4
    # relative), and a sum that differs in its last bits flips an FP8 code now and then: each
    # flip moves an output by ~1e-3, so the bound is on the relative norm.
    if not act_quant:
        torch.testing.assert_close(ops_out, ref, rtol=1e-3, atol=1e-3)
    else:
        rel = ((ops_out - ref).norm() / ref.norm()).item()
        assert rel < 5e-3, rel
        assert (ops_out - ref).abs().max().item() < 0.05


@pytest.mark.gpu
@pytest.mark.parametrize("act_quant", [True, False])
def test_gpu_fp4_moe_replays_in_a_cuda_graph(act_quant):
    E, d, inter, T, topk = 16, 1024, 512, 32, 6
    ws = fp4_experts(E, d, inter, "cuda")
    x = torch.randn(T, d, device="cuda").bfloat16()
    ids = distinct_expert_ids(T, topk, -1, 2 * E, "cuda")
    weights = torch.rand(T, topk, device="cuda")
    out = torch.empty(T, d, device="cuda")
    ops.fp4_fused_moe(x, *ws, ids, weights, 10.0, out, act_quant)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.fp4_fused_moe(x, *ws, ids, weights, 10.0, out, act_quant)
    x.copy_(torch.randn_like(x))
    ids.copy_(distinct_expert_ids(T, topk, -1, 2 * E, "cuda"))  # new routing, same shapes
    graph.replay()
    torch.cuda.synchronize()
    want = ops.fp4_fused_moe(x, *ws, ids, weights, 10.0, torch.empty_like(out), act_quant)
    torch.testing.assert_close(out, want, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("act_quant", [False, True])
@pytest.mark.parametrize("T", [1, 16, 64, 100])  # gemv_config's four tiles
def test_gpu_gemv_fp4_moe_at_flash_dims(flash_experts, act_quant, T):
    ws, E, d, topk = flash_experts, 8, 4096, 6
    from dsv4_kernels import fp4_moe
    x = torch.randn(T, d, device="cuda").bfloat16()
    ids = distinct_expert_ids(T, topk, 0, 2 * E, "cuda")
    weights = torch.rand(T, topk, device="cuda")
    out = fp4_moe.fp4_fused_moe(x, *ws, ids, weights, 10.0, torch.empty(T, d, device="cuda"),
                                act_quant, "gemv")
    ref = Q.fp4_moe_ref(x, *ws, ids, weights, 10.0, act_quant)
    # As test_gpu_bf16_fp4_moe_at_flash_dims: exact products in fp32, so only summation order
    # and (act_quant) an occasional FP8 flip of h differ from the reference.
    if not act_quant:
        torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-3)
    else:
        assert ((out - ref).norm() / ref.norm()).item() < 5e-3
        assert (out - ref).abs().max().item() < 0.05


@pytest.mark.gpu
def test_gpu_gemv_fp4_moe_replays_in_a_cuda_graph():
    from dsv4_kernels import fp4_moe
    E, d, inter, T, topk = 16, 1024, 512, 8, 6
    ws = fp4_experts(E, d, inter, "cuda")
    x = torch.randn(T, d, device="cuda").bfloat16()
    ids = distinct_expert_ids(T, topk, -1, 2 * E, "cuda")
    weights = torch.rand(T, topk, device="cuda")
    out = torch.empty(T, d, device="cuda")

    def run(o):
        return fp4_moe.fp4_fused_moe(x, *ws, ids, weights, 10.0, o, True, "gemv")
    run(out)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(out)
    x.copy_(torch.randn_like(x))
    ids.copy_(distinct_expert_ids(T, topk, -1, 2 * E, "cuda"))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, run(torch.empty_like(out)), rtol=0, atol=0)
