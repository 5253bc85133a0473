"""MoE routing (sqrt-softplus scores, bias selects only, hash layers) and the grouped-GEMM MoE."""

import math

import pytest
import torch

from dsv4_kernels import ops, reference
from kernel_test_utils import require_triton


def _logits_with_scores(scores):
    # softplus(log(e^{s^2} - 1)) = s^2, so the router scores come out as exactly `scores`.
    return torch.tensor([[math.log(math.expm1(s * s)) for s in scores]])


def test_route_by_score_then_normalise_and_scale():
    weights, ids = ops.moe_route(_logits_with_scores([2.0, 1.0, 3.0]), None, 2, 1.5)
    assert ids.dtype == torch.int32 and sorted(ids[0].tolist()) == [0, 2]
    by_id = dict(zip(ids[0].tolist(), weights[0].tolist()))
    assert by_id[2] == pytest.approx(1.5 * 3 / 5) and by_id[0] == pytest.approx(1.5 * 2 / 5)


def test_bias_selects_but_does_not_weigh():
    bias = torch.tensor([0.0, 5.0, 0.0])
    weights, ids = ops.moe_route(_logits_with_scores([2.0, 1.0, 3.0]), bias, 2, 1.0)
    by_id = dict(zip(ids[0].tolist(), weights[0].tolist()))
    assert sorted(by_id) == [1, 2]
    assert by_id[1] == pytest.approx(1 / 4) and by_id[2] == pytest.approx(3 / 4)


def test_hash_layer_routes_by_token_id_with_gate_scores():
    tid2eid = torch.tensor([[0, 1], [1, 2]], dtype=torch.int32)
    weights, ids = ops.moe_route(_logits_with_scores([2.0, 1.0, 3.0]), None, 2, 1.0, tid2eid,
                                 torch.tensor([1]))
    assert ids.tolist() == [[1, 2]]
    assert weights[0].tolist() == pytest.approx([1 / 4, 3 / 4])


def test_align_groups_every_assignment_once_in_single_expert_blocks(device):
    require_triton()
    from dsv4_kernels.moe import moe_align

    E, T, topk, block_m = 8, 37, 3, 16
    ids = torch.stack([torch.randperm(E, device=device)[:topk] for _ in range(T)]).int()
    ids[ids == 6] = 5  # expert 6 gets nothing (a token may now pick 5 twice: still counted)
    sorted_ids, block_expert = moe_align(ids, E, block_m)
    M = T * topk
    assert sorted_ids.shape == ((M + block_m - 1) // block_m * block_m + min(E, M) * block_m,)
    real = sorted_ids[sorted_ids < M]
    assert sorted(real.tolist()) == list(range(M))
    flat = ids.reshape(-1)
    for b, e in enumerate(block_expert.tolist()):
        rows = sorted_ids[b * block_m:(b + 1) * block_m]
        rows = rows[rows < M].long()
        if e == E:
            assert rows.numel() == 0
        else:
            assert (flat[rows] == e).all()


@pytest.mark.parametrize("swiglu_limit", [0.0, 0.7])
def test_triton_fused_moe_matches_reference(device, swiglu_limit):
    require_triton()
    from dsv4_kernels import moe

    T, d, I, E, topk = 13, 64, 48, 8, 3  # I not a multiple of the 32-wide tiles
    x = torch.randn(T, d, device=device)
    w1 = torch.randn(E, I, d, device=device) / 8
    w3 = torch.randn(E, I, d, device=device) / 8
    w2 = torch.randn(E, d, I, device=device) / 7
    weights, ids = reference.moe_route(torch.randn(T, E, device=device), None, topk, 2.5)
    expected = reference.fused_moe(x, w1, w3, w2, ids, weights, swiglu_limit, torch.empty_like(x))
    got = moe.fused_moe(x, w1, w3, w2, ids, weights, swiglu_limit, torch.full_like(x, float("nan")),
                        block_n=32, block_k=32, num_warps=4)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 200])
def test_gpu_bf16_moe_matches_reference(T):
    d, I, E, topk = 1024, 512, 64, 6
    x = torch.randn(T, d, device="cuda").bfloat16()
    w1 = (torch.randn(E, I, d, device="cuda") / 32).bfloat16()
    w3 = (torch.randn(E, I, d, device="cuda") / 32).bfloat16()
    w2 = (torch.randn(E, d, I, device="cuda") / 22).bfloat16()
    weights, ids = ops.moe_route(torch.randn(T, E, device="cuda"), torch.randn(E, device="cuda"), topk, 2.5)
    expected = reference.fused_moe(x, w1, w3, w2, ids, weights, 10.0, torch.empty(T, d, device="cuda"))
    got = ops.fused_moe(x, w1, w3, w2, ids, weights, 10.0, torch.empty_like(x))
    torch.testing.assert_close(got.float(), expected, rtol=3e-2, atol=3e-2)
