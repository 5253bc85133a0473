"""Deterministic top-k on every path: exact ties break by score descending, then candidate
position ascending, so which entries are chosen does not depend on the device, the list
width (batch, graph bucket) or graph vs eager. Inputs are built to contain exact ties."""

from __future__ import annotations

import pytest
import torch
from dsv4_kernels import reference
from dsv4_kernels.reference import topk_indices

from sglang.srt.layers.moe.router import route
from sglang.srt.model_executor.forward_batch_info import ForwardMode, build_forward_batch
from sglang.srt.model_executor.graph_dispatch import eager_path
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.test.runner_args import cpu_server_args


def _stable_order(x: torch.Tensor, k: int) -> torch.Tensor:
    """The specification: a stable descending sort keeps tied entries in position order."""
    return torch.sort(x + 0.0, dim=-1, descending=True, stable=True).indices[:, :k]


def test_ties_go_to_the_earlier_position():
    x = torch.tensor([[0.0, 0.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0],
                      [-0.0, 0.0, -1.0, float("-inf"), 2.0, 2.0, -3e-5, 0.0]])
    assert topk_indices(x, 4).tolist() == [[2, 0, 1, 3], [4, 5, 0, 1]]  # -0.0 ties with +0.0


@pytest.mark.parametrize("k", [1, 5, 40])
def test_equals_a_stable_sort_on_heavily_tied_rows(k):
    g = torch.Generator().manual_seed(k)
    x = torch.randint(-3, 3, (64, 96), generator=g).float() / 4  # 6 distinct values: ties everywhere
    x[x == 0.25] = float("-inf")
    assert torch.equal(topk_indices(x, k), _stable_order(x, k))


def test_the_choice_does_not_depend_on_the_row_width():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 3, (16, 24), generator=g).float()
    narrow = topk_indices(x, 8)
    wide = topk_indices(torch.cat([x, torch.full((16, 40), float("-inf"))], dim=1), 8)
    assert torch.equal(narrow, wide)


def indexer_topk(q, w, keys, cand_slots, cand_len, topk):
    out = torch.empty(cand_slots.shape[0], topk, dtype=torch.int32)
    return reference.indexer_topk(q, w, keys, cand_slots, cand_len, topk, out)


def _tied_indexer_case(T=6, C=20, width=20):
    """Every indexer head weight zero: every visible candidate scores exactly 0."""
    g = torch.Generator().manual_seed(3)
    # 16 dims: the Triton kernel's dot needs K >= 16 (every real config has 64 or more)
    q, keys = torch.randn(T, 4, 16, generator=g), torch.randn(50, 16, generator=g)
    w = torch.zeros(T, 4)
    cand_len = torch.tensor([20, 3, 7, 12, 20, 1], dtype=torch.int32)[:T]
    slots = torch.full((T, width), -1, dtype=torch.int32)
    for t in range(T):
        slots[t, :int(cand_len[t])] = torch.randperm(50, generator=g)[:int(cand_len[t])].int()
    return q, w, keys, slots, cand_len


def test_indexer_topk_ties_are_the_first_candidates_at_every_width():
    topk = 5
    q, w, keys, slots, lens = _tied_indexer_case()
    expected = torch.full((6, topk), -1, dtype=torch.int32)
    for t in range(6):
        n = min(topk, int(lens[t]))
        expected[t, :n] = slots[t, :n]  # the earliest candidates, in position order
    wider = torch.cat([slots, torch.full((6, 44), -1, dtype=torch.int32)], dim=1)  # a graph's static width
    for got in (indexer_topk(q, w, keys, slots, lens, topk), indexer_topk(q, w, keys, wider, lens, topk)):
        assert torch.equal(got, expected)


def test_triton_indexer_topk_ties_match_the_reference():
    pytest.importorskip("triton")
    from dsv4_kernels import indexer

    topk = 5
    q, w, keys, slots, lens = _tied_indexer_case()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    case = [t.to(device) for t in (q, w, keys, slots, lens)]
    out = torch.empty(6, topk, dtype=torch.int32, device=device)
    indexer.indexer_topk(*case, topk, out)
    expected = reference.indexer_topk(q, w, keys, slots, lens, topk, torch.empty(6, topk, dtype=torch.int32))
    # the same selection; the kernel promises no order within it
    assert torch.equal(out.cpu().sort(dim=-1).values, expected.sort(dim=-1).values)


def test_router_ties_go_to_the_lower_expert_id():
    logits = torch.tensor([[0.0, 1.0, 0.0, 1.0, 0.0, 1.0]])
    _, ids = route(logits, 2, 1.0, "sqrtsoftplus")
    assert ids.tolist() == [[1, 3]]
    w, ids = reference.moe_route(logits, torch.zeros(6), 4, 1.0)
    assert ids.tolist() == [[1, 3, 5, 0]]


# ---- the model: a request's tokens do not depend on the batch, the width or the graph -----

CFG = dict(model_path="dsv4-tiny", context_length=512, max_total_tokens=4096, max_running_requests=6)


def _tie_every_indexer_score(runner):
    """Zero the indexer's head weights: every c4 candidate scores exactly 0 (all tied)."""
    for layer in runner.model.layers:
        idx = getattr(layer.attn, "indexer", None)
        if idx is not None:
            idx.weights_proj.weight.zero_()


def _run(runner, chunks, prefixes, path=None):
    rtp = runner.req_to_token_pool
    slots = [rtp.alloc_req() for _ in chunks]
    for s, p, c in zip(slots, prefixes, chunks):
        rtp.ensure_capacity(s, p + len(c))
    fb = build_forward_batch(ForwardMode.EXTEND, slots, prefixes, chunks, "cpu")
    out = runner.forward(fb, path(fb) if path else None).next_token_logits
    for s in slots:
        rtp.free_req(s)
    return out


@pytest.fixture(scope="module")
def tied_runner():
    r = ModelRunner(cpu_server_args(**CFG, enable_breakable_cuda_graph=True, breakable_cuda_graph_tokens=[64]))
    _tie_every_indexer_score(r)
    return r


def test_tied_request_alone_in_a_batch_and_replayed_gives_the_same_logits(tied_runner):
    g = torch.Generator().manual_seed(5)
    mine = torch.randint(3, 500, (40,), generator=g).tolist()  # 10 c4 candidates > top-4: ties matter
    other = torch.randint(3, 500, (200,), generator=g).tolist()  # widens the batch's candidate lists
    alone = _run(tied_runner, [mine], [0], eager_path)[0]
    in_batch = _run(tied_runner, [mine, other], [0, 0], eager_path)[0]
    replayed = _run(tied_runner, [mine], [0])[0]  # 40 tokens -> the 64-token graph (context-wide lists)
    assert tied_runner.breakable_runner.num_replays == 1
    torch.testing.assert_close(in_batch, alone, rtol=0, atol=1e-5)
    torch.testing.assert_close(replayed, alone, rtol=0, atol=1e-5)


# ---- CUDA: the same choices as the CPU -----------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_breaks_ties_exactly_as_the_cpu():
    g = torch.Generator().manual_seed(1)
    x = torch.randint(-2, 3, (300, 1000), generator=g).float()  # 5 distinct values: ties everywhere
    for k in (4, 64, 512):
        assert torch.equal(topk_indices(x.cuda(), k).cpu(), topk_indices(x, k))
    _, ids_cpu = route(x[:, :64], 6, 1.0, "sqrtsoftplus")
    _, ids_cuda = route(x[:, :64].cuda(), 6, 1.0, "sqrtsoftplus")
    assert torch.equal(ids_cuda.cpu(), ids_cpu)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_tied_request_on_cuda_alone_in_a_batch_replayed_and_on_cpu():
    """All indexer scores tied; CUDA (Triton kernels, float32) eager alone, eager in a wider
    batch and replayed from a breakable graph all give the CPU's logits."""
    cuda = ModelRunner(cpu_server_args(**CFG, device="cuda", dtype="float32", enable_breakable_cuda_graph=True,
                                       breakable_cuda_graph_tokens=[64], disable_cuda_graph=True))
    cpu = ModelRunner(cpu_server_args(**CFG))
    for r in (cuda, cpu):
        _tie_every_indexer_score(r)
    g = torch.Generator().manual_seed(5)
    mine = torch.randint(3, 500, (40,), generator=g).tolist()
    other = torch.randint(3, 500, (200,), generator=g).tolist()

    def run(runner, chunks, path=None):
        rtp = runner.req_to_token_pool
        slots = [rtp.alloc_req() for _ in chunks]
        for s, c in zip(slots, chunks):
            rtp.ensure_capacity(s, len(c))
        fb = build_forward_batch(ForwardMode.EXTEND, slots, [0] * len(chunks), chunks, runner.device)
        out = runner.forward(fb, path(fb) if path else None).next_token_logits[0].float().cpu()
        for s in slots:
            rtp.free_req(s)
        return out

    want = run(cpu, [mine], eager_path)
    got = [run(cuda, [mine], eager_path), run(cuda, [mine, other], eager_path), run(cuda, [mine])]
    assert cuda.breakable_runner.num_replays == 1
    for g_ in got:
        assert g_.argmax() == want.argmax()
        torch.testing.assert_close(g_, want, rtol=0, atol=1e-3)
    cuda.shutdown()
