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


def _expert(x, w1, w3, w2, e, weight, limit):
    """One expert on one token, the spec written out in float64: the routing weight scales the
    clamped SwiGLU activation, which is rounded to x's dtype before W2."""
    gate = w1[e].double() @ x.double()
    up = w3[e].double() @ x.double()
    if limit > 0:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    act = (torch.nn.functional.silu(gate) * up * weight).to(x.dtype)
    return w2[e].double() @ act.double()


def _expected(x, w1, w3, w2, ids, weights, limit):
    """sum_k over the ids inside [0, E): every listed assignment counts (duplicates twice)."""
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for t in range(x.shape[0]):
        for e, w in zip(ids[t].tolist(), weights[t].tolist()):
            if 0 <= e < w1.shape[0]:
                out[t] += _expert(x[t], w1, w3, w2, e, w, limit)
    return out


def _random_experts(E, d, I, device, dtype=torch.float32):
    w1 = torch.randn(E, I, d, device=device) / 8
    w3 = torch.randn(E, I, d, device=device) / 8
    w2 = torch.randn(E, d, I, device=device) / 7
    return w1.to(dtype), w3.to(dtype), w2.to(dtype)


@pytest.fixture
def poisoned_scratch(monkeypatch):
    """torch.empty returns NaN-filled floats while a test runs: kernels that read scratch they
    never wrote (or sum a row nobody computed) fail loudly, also where fresh memory is zero."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", empty)


def test_align_groups_every_assignment_once_in_single_expert_blocks(device):
    require_triton()
    from dsv4_kernels.moe import moe_align

    E, T, topk, block_m = 8, 37, 3, 16
    ids = torch.stack([torch.randperm(E, device=device)[:topk] for _ in range(T)]).int()
    ids[ids == 6] = 5  # expert 6 gets nothing (a token may now pick 5 twice: still counted)
    ids[3, 1], ids[9, 0], ids[9, 2], ids[20, 2] = -1, E, -7, E + 5  # outside [0, E): skipped
    skipped = {3 * topk + 1, 9 * topk + 0, 9 * topk + 2, 20 * topk + 2}
    sorted_ids, block_expert = moe_align(ids, E, block_m)
    M = T * topk
    assert sorted_ids.shape == ((M + block_m - 1) // block_m * block_m + min(E, M) * block_m,)
    real = sorted_ids[sorted_ids < M]
    assert sorted(real.tolist()) == sorted(set(range(M)) - skipped)
    assert (sorted_ids[sorted_ids >= M] == M).all()
    flat = ids.reshape(-1)
    for b, e in enumerate(block_expert.tolist()):
        rows = sorted_ids[b * block_m:(b + 1) * block_m]
        rows = rows[rows < M].long()
        if e == E:
            assert rows.numel() == 0
        else:
            assert (flat[rows] == e).all()


@pytest.mark.parametrize("E,T,topk,block_m", [(8, 37, 3, 16), (256, 1, 6, 16), (5, 16, 2, 64), (256, 90, 6, 8),
                                             (128, 600, 6, 32), (256, 64, 6, 16), (256, 682, 6, 64)])
def test_one_kernel_align_equals_the_torch_align(device, monkeypatch, E, T, topk, block_m):
    require_triton()
    from dsv4_kernels import moe

    assert T * topk <= moe.ALIGN_ONE_KERNEL_MAX_M  # small batches take the one-kernel path
    ids = torch.randint(-2, E + 2, (T, topk), dtype=torch.int32, device=device)
    ids[0, 0] = E - 1
    fast = moe.moe_align(ids, E, block_m, return_used=True)
    monkeypatch.setattr(moe, "ALIGN_ONE_KERNEL_MAX_M", 0)
    slow = moe.moe_align(ids, E, block_m, return_used=True)
    assert torch.equal(fast[0], slow[0]) and torch.equal(fast[1], slow[1])
    # the entries in use: every used block (they come first) times block_m, on both paths
    used_blocks = int((fast[1] < E).sum())
    assert (fast[1][:used_blocks] < E).all()
    assert fast[2].dtype == slow[2].dtype == torch.int32 and fast[2].dim() == 0
    assert int(fast[2]) == int(slow[2]) == used_blocks * block_m


@pytest.mark.parametrize("swiglu_limit", [0.0, 0.7])
def test_triton_fused_moe_matches_reference(device, swiglu_limit):
    require_triton()
    from dsv4_kernels import moe

    T, d, I, E, topk = 13, 64, 48, 8, 3  # I not a multiple of the 32-wide tiles
    x = torch.randn(T, d, device=device)
    w1, w3, w2 = _random_experts(E, d, I, device)
    weights, ids = reference.moe_route(torch.randn(T, E, device=device), None, topk, 2.5)
    expected = reference.fused_moe(x, w1, w3, w2, ids, weights, swiglu_limit, torch.empty_like(x))
    got = moe.fused_moe(x, w1, w3, w2, ids, weights, swiglu_limit, torch.full_like(x, float("nan")),
                        block_n=32, block_k=32, num_warps=4)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.double(), _expected(x, w1, w3, w2, ids, weights, swiglu_limit),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_fused_moe_skips_ids_outside_the_experts_and_counts_duplicates(device, impl,
                                                                        poisoned_scratch):
    """Ids outside [0, E) (another DP rank's experts, or occurrences the caller dropped)
    contribute exactly zero, also for a token with no expert left; a listed duplicate counts
    twice (deduplicating hash routing is the caller's job)."""
    if impl == "triton":
        require_triton()
        from dsv4_kernels.moe import fused_moe
    else:
        fused_moe = reference.fused_moe
    T, d, I, E, topk, limit = 6, 32, 40, 4, 3, 0.9
    x = torch.randn(T, d, device=device) * 2
    w1, w3, w2 = _random_experts(E, d, I, device)
    weights = torch.rand(T, topk, device=device) + 0.2
    ids = torch.tensor([[0, 2, 3], [-1, 1, E], [E + 2, -3, -1], [1, 1, 2], [3, E, 3], [2, 0, 1]],
                       dtype=torch.int32, device=device)
    got = fused_moe(x, w1, w3, w2, ids, weights, limit, torch.full_like(x, float("nan")))
    expected = _expected(x, w1, w3, w2, ids, weights, limit)
    assert got[2].eq(0).all()  # every assignment skipped: exactly zero, not uninitialised memory
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    # the duplicate row is the sum of both listed occurrences
    twice = _expert(x[3], w1, w3, w2, 1, weights[3, 0].item(), limit) \
        + _expert(x[3], w1, w3, w2, 1, weights[3, 1].item(), limit)
    torch.testing.assert_close(got[3].double(), twice + _expert(x[3], w1, w3, w2, 2, weights[3, 2].item(), limit),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_routing_weight_scales_the_activation_before_it_is_rounded_for_w2(device, impl):
    """In fp16 an unclamped SwiGLU activation of ~1e5 overflows (max 65504) unless the routing
    weight (1/64 here) scales it first, as the model does: weighting after W2 would give inf."""
    if impl == "triton":
        require_triton()
        from dsv4_kernels.moe import fused_moe
    else:
        fused_moe = reference.fused_moe
    T, d, I, E, topk = 3, 16, 16, 2, 2
    x = torch.full((T, d), 2.0, device=device) + torch.rand(T, d, device=device) / 4
    w1 = (torch.rand(E, I, d, device=device) * 0.5 + 9.5).half()  # W1 x, W3 x ~ 330: ~1e5 after SwiGLU
    w3 = (torch.rand(E, I, d, device=device) * 0.5 + 9.5).half()
    w2 = (torch.rand(E, d, I, device=device) * 0.01).half()
    x = x.half()
    ids = torch.tensor([[0, 1], [1, 0], [1, -1]], dtype=torch.int32, device=device)
    weights = torch.full((T, topk), 1 / 64, device=device) * (1 + torch.rand(T, topk, device=device) / 8)
    h_max = max((torch.nn.functional.silu(w1[e].float() @ x[t].float()) * (w3[e].float() @ x[t].float())).max()
                for t in range(T) for e in range(E))
    assert h_max > torch.finfo(torch.float16).max  # would overflow unweighted
    got = fused_moe(x, w1, w3, w2, ids, weights, 0.0, torch.empty(T, d, device=device))
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), _expected(x, w1, w3, w2, ids, weights, 0.0), rtol=2e-3, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 200])
@pytest.mark.parametrize("shard", [False, True])
def test_gpu_bf16_moe_matches_reference(T, shard):
    """Real tile sizes, compiled. With `shard`, routing picks among 2E experts and this rank
    holds [E/2, 3E/2): ids shifted to local fall partly outside [0, E) and are skipped."""
    d, I, E, topk = 1024, 512, 64, 6
    x = torch.randn(T, d, device="cuda").bfloat16()
    w1 = (torch.randn(E, I, d, device="cuda") / 32).bfloat16()
    w3 = (torch.randn(E, I, d, device="cuda") / 32).bfloat16()
    w2 = (torch.randn(E, d, I, device="cuda") / 22).bfloat16()
    n_route = 2 * E if shard else E
    weights, ids = ops.moe_route(torch.randn(T, n_route, device="cuda"), torch.randn(n_route, device="cuda"),
                                 topk, 2.5)
    if shard:
        ids = ids - E // 2
        assert ((ids < 0) | (ids >= E)).any() or T == 1
    expected = reference.fused_moe(x, w1, w3, w2, ids, weights, 10.0, torch.empty(T, d, device="cuda"))
    got = ops.fused_moe(x, w1, w3, w2, ids, weights, 10.0, torch.empty_like(x))
    torch.testing.assert_close(got.float(), expected, rtol=3e-2, atol=3e-2)
    got32 = ops.fused_moe(x, w1, w3, w2, ids, weights, 10.0, torch.empty(T, d, device="cuda"))
    torch.testing.assert_close(got32, expected, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("first,drop", [(0, True), (64, True), (64, False)])
def test_local_expert_ids_kernel_is_the_reference(device, first, drop):
    """Local ids in one launch: the offset by the rank's first expert, and every occurrence of
    an id that repeats later in its row dropped (-1), as the torch formula does."""
    require_triton()
    from dsv4_kernels import moe, reference
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 6, (70, 6), generator=g)  # 6 values over 6 slots: many repeats
    ids[0] = torch.tensor([5, 5, 5, 1, 2, 1])
    ids = ids.to(device)
    got = moe.local_expert_ids(ids, first, drop)
    want = reference.local_expert_ids(ids, first, drop)
    assert got.dtype == ids.dtype and torch.equal(got, want)
    if drop:  # row 0: [5, 5, 5, 1, 2, 1] keeps its last 5 and its last 1
        assert got[0].tolist() == [-1, -1, 5 - first, -1, 2 - first, 1 - first]
    if first == 0 and drop:
        # each kept id appears once per row, and every distinct id of the row is kept
        for row, orig in zip(got.tolist(), ids.tolist()):
            kept = [i for i in row if i >= 0]
            assert len(kept) == len(set(kept)) and set(kept) == set(orig)
