"""The grouped FP4 MoE variant (fp4_grouped_moe.py, large batches) against
quant_reference.fp4_moe_ref, and against an emulation of its own bf16 numerics at Flash dims
on the GPU. Tolerances as in test_kernels_fp4_moe.py."""

import pytest
import torch

from dsv4_kernels import quant_reference as Q
from kernel_test_utils import distinct_expert_ids, fp4_experts, require_triton


# ---------------------------------------------------------------------------------------
# The grouped variant (large batches): experts decoded to bf16 per group, torch._grouped_mm
# (a loop of torch.mm on the CPU). fp32 on the CPU: the interpreter's fp32 -> bf16 cast
# truncates (the GPU's rounds to nearest even), so bf16 numerics are tested on the GPU.
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("T,group_experts,act_quant,row_programs,overlap", [
    (1, 2, True, 128, False), (7, 2, False, 128, False),
    # one row slot per column block, 2-row blocks: each slot loops over the group's blocks
    (7, 2, True, 1, False),
    (7, 16, False, 1, False),  # one group holding every expert
    (7, 2, True, 128, True),  # decodes on a side stream on a GPU (ignored on the CPU)
])
def test_grouped_variant_matches_reference(device, monkeypatch, T, group_experts, act_quant,
                                           row_programs, overlap):
    require_triton()
    from dsv4_kernels import fp4_grouped_moe, fp4_moe
    monkeypatch.setattr(fp4_grouped_moe, "ROW_PROGRAMS", row_programs)
    if row_programs == 1:
        monkeypatch.setattr(fp4_grouped_moe, "BLOCK_R", 2)
    E, d, inter, topk = 5, 128, 256, 3  # 5 experts in groups of 2: a last group of one
    torch.manual_seed(T)
    ws = fp4_experts(E, d, inter, device)
    x = torch.randn(T, d, device=device)
    ids = distinct_expert_ids(T, topk, -1, E + 2, device)  # some skipped: -1 or another shard's
    weights = torch.rand(T, topk, device=device)
    out = torch.full((T, d), float("nan"), device=device)
    res = fp4_moe.fp4_fused_moe(x, *ws, ids, weights, 1.5, out, act_quant, "grouped",
                                config=dict(group_experts=group_experts, overlap=overlap))
    assert res is out
    torch.testing.assert_close(out, Q.fp4_moe_ref(x, *ws, ids, weights, 1.5, act_quant),
                               rtol=1e-5, atol=1e-5)


def test_grouped_variant_empty_groups_skipped_rows_and_duplicates(device):
    require_triton()
    from dsv4_kernels import fp4_moe
    E, d, inter = 6, 128, 128
    ws = fp4_experts(E, d, inter, device)
    x = torch.randn(4, d, device=device) * 4
    # Groups of 2: experts 0-1 get no row at all, 2-3 one token with expert 3 twice (weight-only
    # fp32: h unrounded, so the two rows add up to the reference's one with summed weight),
    # row 1 nothing local, 4-5 rows 2 and 3.
    ids = torch.tensor([[3, 3, 2], [-1, 6, 9], [4, 5, -1], [5, -1, 7]], dtype=torch.int32,
                       device=device)
    weights = torch.tensor([[0.5, 0.25, 2.0], [1.0, 1.0, 1.0], [0.75, 1.5, 9.0],
                            [0.3, 0.6, 0.9]], device=device)
    out = fp4_moe.fp4_fused_moe(x, *ws, ids, weights, 0.0, torch.empty(4, d, device=device),
                                False, "grouped", config=dict(group_experts=2))
    assert out[1].eq(0).all()
    torch.testing.assert_close(out, Q.fp4_moe_ref(x, *ws, ids, weights, 0.0, False),
                               rtol=1e-5, atol=1e-5)
    empty = torch.zeros(0, d, device=device)
    none = fp4_moe.fp4_fused_moe(x[:0], *ws, ids[:0], weights[:0], 0.0, empty, True, "grouped")
    assert none is empty and none.shape == (0, d)
    with pytest.raises(ValueError, match="group_experts must be >= 1"):
        fp4_moe.fp4_fused_moe(x, *ws, ids, weights, 0.0, out, False, "grouped",
                              config=dict(group_experts=0))


def test_route_by_expert_groups_rows_on_the_device(device):
    require_triton()
    from dsv4_kernels.fp4_grouped_moe import route_by_expert
    # 5 experts in groups of 2 ({0,1}, {2,3}, {4}); -1 and 7 are skipped.
    ids = torch.tensor([[3, 0, -1], [0, 4, 7], [1, 3, 0]], dtype=torch.int32, device=device)
    order, bounds, offs = route_by_expert(ids, 5, 2)
    assert order.dtype == bounds.dtype == offs.dtype == torch.int32
    # sorted by expert, stable: expert 0 at assignments 1, 3, 8; 1 at 6; 3 at 0, 7; 4 at 4;
    # then the skipped 2 and 5 (in either order: they belong to no group)
    assert order[:7].tolist() == [1, 3, 8, 6, 0, 7, 4]
    assert sorted(order[7:].tolist()) == [2, 5]
    assert bounds.tolist() == [0, 4, 6, 7]
    # each expert's end row within its group: group {0,1}: 3, 4; {2,3}: 0, 2; {4}: 1
    assert offs.tolist() == [3, 4, 0, 2, 1]


def test_grouped_decode_kernel_is_exact_and_transposed(device):
    require_triton()
    from dsv4_kernels.fp4_grouped_moe import _decode_group
    E, n, k = 3, 96, 256
    p, s = Q.quantize_fp4(torch.randn(E, n, k) * 3)
    s[0, 0, 0] = 200  # a large scale and the smallest ones the release can hold
    s[2, 5, 3] = 2
    p, s = p.to(device), s.to(device)
    out = torch.full((2, k, 2 * n), float("nan"), device=device)
    _decode_group(p, s, 1, 2, out, n)  # experts 1, 2 into the right half of the columns
    want = Q.dequantize_fp4(p[1:], s[1:]).transpose(1, 2)
    assert torch.equal(out[:, :, n:], want)
    assert out[:, :, :n].isnan().all()  # the other half untouched
    _decode_group(p, s, 0, 1, out, 0)
    assert torch.equal(out[0, :, :n], Q.dequantize_fp4(p[0], s[0]).t())


def test_grouped_is_never_selected_by_default():
    require_triton()
    from dsv4_kernels import fp4_moe
    # The bf16 decode with one dot per step measured faster where grouped beat the others
    # (T = 1536 and 4096 on an H200), so grouped stays opt-in.
    Ts = (1, 64, 2048, 4096, 8192, 65536)
    assert "grouped" in fp4_moe.VARIANTS
    for dt in (torch.bfloat16, torch.float16):
        assert all(fp4_moe.select_variant(T, 6, True, dt) != "grouped" for T in Ts)
    assert [fp4_moe.default_variant(T, 6) for T in Ts] == ["gemv", "bf16", "bf16", "bf16", "bf16", "bf16"]


def _grouped_numerics_ref(x, w1, s1, w3, s3, w2, s2, ids, weights, limit, act_quant):
    """fp4_moe_ref with the grouped variant's extra roundings (torch._grouped_mm returns x's
    dtype): gate and up rounded to x's dtype before the SwiGLU, each assignment's down partial
    before the fp32 sum. Distinct ids per row (dense over experts, like fp4_moe_ref)."""
    xf = (Q.fp8_round_blocks(x) if act_quant else x).float()
    acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(w1.shape[0]):
        gate_w = (weights.float() * (ids == e)).sum(dim=1, keepdim=True)
        g = (xf @ Q.dequantize_fp4(w1[e], s1[e]).t()).to(x.dtype)
        u = (xf @ Q.dequantize_fp4(w3[e], s3[e]).t()).to(x.dtype)
        h = (Q.swiglu_clamped(g, u, limit) * gate_w).to(x.dtype)
        if act_quant:
            h = Q.fp8_round_blocks(h)
        acc += (h.float() @ Q.dequantize_fp4(w2[e], s2[e]).t()).to(x.dtype).float()
    return acc


@pytest.mark.gpu
@pytest.mark.parametrize("act_quant", [False, True])
@pytest.mark.parametrize("T,group_experts,overlap", [
    (1, 16, False), (1500, 16, False), (4096, 16, False), (1500, 3, False), (4096, 3, True)])
def test_gpu_grouped_fp4_moe_at_flash_dims(flash_experts, act_quant, T, group_experts, overlap):
    ws, E, d, topk = flash_experts, 8, 4096, 6
    from dsv4_kernels import fp4_moe
    torch.manual_seed(T)
    x = torch.randn(T, d, device="cuda").bfloat16()
    ids = distinct_expert_ids(T, topk, 0, 2 * E, "cuda")  # half of them on the other shard
    weights = torch.rand(T, topk, device="cuda")
    out = fp4_moe.fp4_fused_moe(x, *ws, ids, weights, 10.0, torch.empty(T, d, device="cuda"),
                                act_quant, "grouped",
                                config=dict(group_experts=group_experts, overlap=overlap))
    # Against the same numerics in torch, on up to 64 rows: only fp32 summation order differs
    # (a bf16 flip of gate/up now and then, and through it an FP8 flip of h with act_quant).
    rows = torch.linspace(0, T - 1, min(T, 64), device="cuda").long().unique()
    want = _grouped_numerics_ref(x[rows], *ws, ids[rows], weights[rows], 10.0, act_quant)
    got = out[rows]
    assert ((got - want).norm() / want.norm()).item() < 2e-3
    assert (got - want).abs().max().item() < 0.05
    # Against the bf16 variant (fp32 gate/up and partials) on every row: the extra bf16
    # roundings, and the FP8 flips of h they cause with act_quant (~0.4% / ~1.3% relative in a
    # CPU emulation at d = 512).
    bf16 = fp4_moe.fp4_fused_moe(x, *ws, ids, weights, 10.0, torch.empty(T, d, device="cuda"),
                                 act_quant, "bf16")
    rel = ((out - bf16).norm() / bf16.norm()).item()
    assert rel < (3e-2 if act_quant else 1e-2), rel


@pytest.mark.gpu
@pytest.mark.parametrize("act_quant,overlap", [(True, False), (False, False), (True, True)])
def test_gpu_grouped_fp4_moe_replays_in_a_cuda_graph(act_quant, overlap):
    from dsv4_kernels import fp4_moe
    E, d, inter, T, topk = 16, 1024, 512, 256, 6
    ws = fp4_experts(E, d, inter, "cuda")
    x = torch.randn(T, d, device="cuda").bfloat16()
    ids = distinct_expert_ids(T, topk, -1, 2 * E, "cuda")
    weights = torch.rand(T, topk, device="cuda")
    out = torch.empty(T, d, device="cuda")

    def run(o):  # 4 groups of 4 experts
        return fp4_moe.fp4_fused_moe(x, *ws, ids, weights, 10.0, o, act_quant, "grouped",
                                     config=dict(group_experts=4, overlap=overlap))
    run(out)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run(out)
    x.copy_(torch.randn_like(x))
    ids.copy_(distinct_expert_ids(T, topk, -1, 2 * E, "cuda"))  # new routing: new group sizes
    ids[:8] = -1  # some tokens with nothing local
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, run(torch.empty_like(out)), rtol=0, atol=0)
    assert out[:8].eq(0).all()


@pytest.mark.gpu
def test_gpu_grouped_refuses_non_bf16_under_capture(monkeypatch):
    from dsv4_kernels import fp4_moe
    ws = fp4_experts(2, 128, 128, "cuda")
    x = torch.randn(2, 128, device="cuda")  # fp32: torch._grouped_mm would read offs on the host
    ids = torch.tensor([[0, 1], [1, -1]], dtype=torch.int32, device="cuda")
    weights = torch.rand(2, 2, device="cuda")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(ValueError, match="graph-capturable with bf16 activations only"):
        fp4_moe.fp4_fused_moe(x, *ws, ids, weights, 1.0, torch.empty(2, 128, device="cuda"),
                              True, "grouped")
