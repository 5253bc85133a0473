"""The one-launch MoE router (router.py) against reference.moe_route: the same experts in the
same order (score descending, ties by lower id) and the same weights."""

import pytest
import torch

from dsv4_kernels import reference
from kernel_test_utils import require_triton


def _case(device, T=7, E=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g) * 3
    logits[0, :] = logits[0, 5]  # a row of exact ties: the lowest ids win
    logits[1, 10:20] = 25.0  # above softplus's threshold: score sqrt(x)
    logits[2, :3] = -0.0
    bias = torch.randn(E, generator=g) * 0.1
    return logits.to(device), bias.to(device)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("E,topk", [(256, 6), (12, 3), (33, 8)])
def test_router_kernel_equals_the_reference(device, with_bias, E, topk):
    require_triton()
    from dsv4_kernels import router
    logits, bias = _case(device, E=E)
    b = bias if with_bias else None
    w, ids = router.moe_route(logits, b, topk, 2.5, ids_dtype=torch.int64)
    w_ref, ids_ref = reference.moe_route(logits.cpu(), None if b is None else b.cpu(), topk, 2.5,
                                         ids_dtype=torch.int64)
    assert ids.dtype == torch.int64 and torch.equal(ids.cpu(), ids_ref)
    torch.testing.assert_close(w.cpu(), w_ref, rtol=5e-7, atol=0)  # one ulp: the interpreter's log1p and sum order
    if not with_bias:
        assert ids[0].tolist() == list(range(topk))  # exact ties: the lower expert ids, in order


def test_router_kernel_hash_layer_takes_the_table(device):
    require_triton()
    from dsv4_kernels import router
    logits, _ = _case(device, T=4, E=16)
    tid2eid = torch.randint(0, 16, (50, 3), dtype=torch.int32, generator=torch.Generator().manual_seed(1))
    input_ids = torch.tensor([3, 49, 0, 3])
    w, ids = router.moe_route(logits, None, 3, 1.5, tid2eid.to(device), input_ids.to(device))
    w_ref, ids_ref = reference.moe_route(logits.cpu(), None, 3, 1.5, tid2eid, input_ids)
    assert ids.dtype == torch.int32 and torch.equal(ids.cpu(), ids_ref)
    torch.testing.assert_close(w.cpu(), w_ref, rtol=5e-7, atol=0)  # one ulp: the interpreter's log1p and sum order
    with pytest.raises(ValueError, match="hash table"):
        router.moe_route(logits, None, 4, 1.5, tid2eid.to(device), input_ids.to(device))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 64, 4096])
def test_gpu_router_kernel_matches_torch(T):
    """On CUDA the experts and their order are the torch path's (reference.moe_route on the GPU)
    exactly; the weights agree to a few ulps (their six-term sum runs in selection order, torch's
    reduction takes its own)."""
    from dsv4_kernels import router
    logits = torch.randn(T, 256, device="cuda") * 4
    bias = torch.randn(256, device="cuda") * 0.05
    w, ids = router.moe_route(logits, bias, 6, 2.5, ids_dtype=torch.int64)
    w_ref, ids_ref = reference.moe_route(logits, bias, 6, 2.5, ids_dtype=torch.int64)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, rtol=1e-6, atol=0)
