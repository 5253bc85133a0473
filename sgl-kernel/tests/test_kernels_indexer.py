"""indexer_topk: weighted-ReLU logits over visible c4 entries, static-shape top-k of slots."""

import pytest
import torch

from dsv4_kernels import PageTableList, ops, reference
from kernel_test_utils import paged_page_table, random_index_lists, require_triton


def _hand_case():
    q = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])  # head 0 reads dim 0, head 1 dim 1
    weights = torch.tensor([[2.0, 3.0]])
    keys = torch.tensor([[1.0, 1.0], [-1.0, 2.0], [4.0, -1.0], [9.0, 9.0]])
    # Logits of slots 2, 0, 1: 8, 5 and 6 (negative dots are cut by the ReLU); slot 3 lies
    # beyond cand_len and must never be picked.
    cand_slots = torch.tensor([[2, 0, 1, 3]], dtype=torch.int32)
    return q, weights, keys, cand_slots, torch.tensor([3], dtype=torch.int32)


def test_reference_logits_by_hand():
    logits = reference.indexer_logits(*_hand_case())
    assert logits.tolist() == [[8.0, 5.0, 6.0, float("-inf")]]


@pytest.mark.parametrize("topk, expected", [(2, [2, 1]), (5, [2, 1, 0, -1, -1])])
def test_reference_topk_pads_with_minus_one(topk, expected):
    out = torch.empty(1, topk, dtype=torch.int32)
    reference.indexer_topk(*_hand_case(), topk, out)
    assert sorted(out[0].tolist()) == sorted(expected)


@pytest.fixture(params=["select", "wide"])
def selection(request, monkeypatch):
    """Both selections of indexer_topk: the select kernel (lists up to SELECT_MAX_WIDTH wide)
    and the wide lists' int64 keys + torch.topk + slot kernel (forced with a zero bound)."""
    if request.param == "wide":
        from dsv4_kernels import indexer
        monkeypatch.setattr(indexer, "SELECT_MAX_WIDTH", 0)
    return request.param


def _rows_sorted(slots: torch.Tensor) -> torch.Tensor:
    """Each token's chosen slots as a sorted row: the op promises a selection, not an order."""
    return slots.sort(dim=-1).values


def _random_case(device, T, NH, DI, C, lengths, S=500, dtype=torch.float32):
    q = torch.randn(T, NH, DI, device=device).to(dtype)
    weights = torch.rand(T, NH, device=device) / NH
    keys = torch.randn(S, DI, device=device).to(dtype)
    slots, lens = random_index_lists(T, C, S, lengths, pad_prob=0.0, device=device)
    # Each token's candidates are distinct slots, as the c4 page table gives them.
    slots = torch.stack([torch.randperm(S, device=device)[:C] for _ in range(T)]).int()
    return q, weights, keys, slots, lens


def _assert_same_selection(got, q, weights, keys, slots, lens, topk):
    """Same number of picks per row, valid distinct candidates, and the same multiset of
    scores as the reference (robust to ties, frequent with ReLU zeros)."""
    logits = reference.indexer_logits(q, weights, keys, slots, lens)
    ref = reference.select_topk_slots(logits, slots, topk, torch.empty_like(got))
    for t in range(got.shape[0]):
        picked = got[t][got[t] >= 0]
        assert picked.numel() == min(topk, int(lens[t])) == (ref[t] >= 0).sum()
        assert picked.unique().numel() == picked.numel()
        score_of = {int(s): float(v) for s, v in zip(slots[t, : lens[t]], logits[t, : lens[t]])}
        got_scores = sorted(score_of[int(s)] for s in picked)
        ref_scores = sorted(score_of[int(s)] for s in ref[t][ref[t] >= 0])
        assert got_scores == pytest.approx(ref_scores, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("num_heads", [4, 20])
def test_triton_logits_match_reference(device, num_heads):
    require_triton()
    from dsv4_kernels import indexer

    # Lengths 0, 1 and at the 64-row tile and 256-row program edges.
    case = _random_case(device, 7, num_heads, 32, 300, [0, 1, 64, 256, 257, 300, 65])
    expected = reference.indexer_logits(*case)
    got = indexer.indexer_logits(*case)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("C, topk", [(300, 64), (40, 64), (0, 8)])
def test_triton_topk_selects_best_visible_slots(device, C, topk, selection):
    require_triton()
    from dsv4_kernels import indexer

    lengths = [min(C, n) for n in [0, 1, 63, 64, 65, 300]]
    case = _random_case(device, len(lengths), 4, 32, C, lengths)
    out = torch.full((len(lengths), topk), 12345, dtype=torch.int32, device=device)
    assert indexer.indexer_topk(*case, topk, out) is out
    _assert_same_selection(out.cpu(), *[x.cpu() for x in case], topk)
    assert (out[0] == -1).all()


def _integer_case(device, lengths, C, NH=4, DI=16, S=300, negative_weights=False):
    """Small-integer q, keys and weights: every score is exact in fp32 (so the kernel's and
    the reference's logits are equal) and tied often; negative weights make -0.0 scores."""
    T = len(lengths)
    q = torch.randint(-2, 3, (T, NH, DI)).float()
    keys = torch.randint(-2, 3, (S, DI)).float()
    weights = torch.randint(-2, 3, (T, NH)).float() / 2
    if negative_weights:
        weights = -weights.abs() - 0.5  # every score is a sum of non-positive terms: 0 or -0.0 when the ReLU cuts
    slots = torch.stack([torch.randperm(S)[:C] for _ in range(T)]).int()
    slots[torch.rand(T, C) < 0.05] = -1  # padding inside the lists
    lens = torch.as_tensor(lengths, dtype=torch.int32)
    return [x.to(device) for x in (q, weights, keys, slots, lens)]


@pytest.mark.parametrize("C, topk", [(300, 64), (40, 64), (64, 64), (1, 8)])
@pytest.mark.parametrize("negative_weights", [False, True])
def test_triton_topk_equals_the_reference_exactly_on_tied_scores(device, C, topk, negative_weights, selection):
    """The reference's slots (ties: the lower candidate position), in whatever order, on
    scores full of exact ties, -0.0 among them."""
    require_triton()
    from dsv4_kernels import indexer

    lengths = [min(C, n) for n in [0, 1, 63, 64, 65, 300, 17]]
    case = _integer_case(device, lengths, C, negative_weights=negative_weights)
    torch.testing.assert_close(indexer.indexer_logits(*case), reference.indexer_logits(*case), rtol=0, atol=0)
    out = torch.full((len(lengths), topk), 12345, dtype=torch.int32, device=device)
    indexer.indexer_topk(*case, topk, out)
    want = reference.indexer_topk(*[x.cpu() for x in case], topk, torch.empty(len(lengths), topk, dtype=torch.int32))
    assert torch.equal(_rows_sorted(out.cpu()), _rows_sorted(want))


def _ordered(scores: torch.Tensor) -> torch.Tensor:
    """fp32 scores as their order-preserving int32 (the logits kernel's ordered=True)."""
    bits = (scores.float() + 0.0).view(torch.int32)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def _near_tied_scores(T, C, seed):
    """Scores that agree in their high bytes: ulp neighbours of a few values, exact ties,
    +-0.0, negatives and -inf (masked), so the radix select must go down to the last byte."""
    g = torch.Generator().manual_seed(seed)
    base = torch.tensor([1.5, -2.25, 0.0, 1e-30, 3.0e4])[torch.randint(0, 5, (T, C), generator=g)]
    steps = torch.randint(-3, 4, (T, C), generator=g)
    scores = base.clone()
    for _ in range(3):  # walk up to 3 ulps either way
        scores = torch.where(steps > 0, torch.nextafter(scores, torch.tensor(float("inf"))), scores)
        scores = torch.where(steps < 0, torch.nextafter(scores, torch.tensor(float("-inf"))), scores)
        steps = steps - steps.sign()
    scores[torch.rand(T, C, generator=g) < 0.1] = -0.0
    scores[torch.rand(T, C, generator=g) < 0.1] = float("-inf")
    return scores


@pytest.mark.parametrize("topk", [1, 7, 64, 200])
def test_triton_select_equals_the_reference_on_near_tied_scores(device, topk):
    """The select kernel's slots equal the reference's (score descending, ties by the lower
    position, -inf never chosen) on scores that differ only in their lowest bits, for rows
    below, at and above topk live candidates, and over more candidates than one pass step."""
    require_triton()
    from dsv4_kernels import indexer

    T, C = 8, 1500
    scores = _near_tied_scores(T, C, seed=topk)
    lengths = torch.tensor([0, 1, topk, topk + 1, 1024, 1025, 1500, 37], dtype=torch.int32)
    scores[torch.arange(C)[None, :] >= lengths[:, None]] = float("-inf")  # what the logits kernel stores
    slots = torch.stack([torch.randperm(5000)[:C] for _ in range(T)]).int()
    want = reference.select_topk_slots(scores, slots, topk, torch.empty(T, topk, dtype=torch.int32))
    got = indexer.select_topk_slots(_ordered(scores).to(device), slots.to(device), lengths.to(device), topk,
                                    torch.full((T, topk), 7, dtype=torch.int32, device=device)).cpu()
    assert torch.equal(_rows_sorted(got), _rows_sorted(want))
    # live slots lead in candidate order, -1 after them (the attention reads the first topk_len)
    for t in range(T):
        n = int((want[t] >= 0).sum())
        position = {int(s): j for j, s in enumerate(slots[t].tolist())}
        assert [position[int(s)] for s in got[t, :n]] == sorted(position[int(s)] for s in got[t, :n])
        assert (got[t, n:] == -1).all(), (t, got[t].tolist())
    # the wide lists' selection from int64 keys: the same slots, live ones first
    keys = _ordered(scores).long() * (1 << 32) + (C - 1 - torch.arange(C))
    wide = indexer.topk_slots_by_keys(keys.to(device), slots.to(device), lengths.to(device), topk,
                                      torch.full((T, topk), 7, dtype=torch.int32, device=device)).cpu()
    assert torch.equal(_rows_sorted(wide), _rows_sorted(want))
    for t in range(T):
        n = int((want[t] >= 0).sum())
        assert (wide[t, :n] >= 0).all() and (wide[t, n:] == -1).all(), (t, wide[t].tolist())


def test_triton_topk_chunks_of_tokens_equal_one_pass(device, monkeypatch, selection):
    require_triton()
    from dsv4_kernels import indexer

    lengths = [0, 5, 40, 40, 33, 2, 40]
    case = _integer_case(device, lengths, 40)
    whole = indexer.indexer_topk(*case, 16, torch.empty(7, 16, dtype=torch.int32, device=device))
    per_token = 40 * (2 if selection == "wide" else 1)  # int64 keys count twice
    monkeypatch.setattr(indexer, "MAX_LOGITS_ELEMENTS", per_token * 3)  # 3 tokens per chunk
    chunked = indexer.indexer_topk(*case, 16, torch.full((7, 16), 7, dtype=torch.int32, device=device))
    assert torch.equal(chunked, whole)


# ---- candidates read through the page table (PageTableList, the runtime's form) ----------


def _paged_case(device, lengths, NH=4, DI=32, context=1280, num_rows=3, dtype=torch.float32):
    """Candidates of each token = the c4 entries of a random page-table row; the key pool
    covers every c4 slot of the table."""
    T = len(lengths)
    rtt = paged_page_table(num_rows, context, device=device, seed=T)
    rows = torch.randint(0, num_rows, (T,), device=device, dtype=torch.int32)
    cands = PageTableList(rtt, rows, 4, context // 4)
    q = torch.randn(T, NH, DI, device=device).to(dtype)
    weights = torch.rand(T, NH, device=device) / NH
    keys = torch.randn(num_rows * context // 4, DI, device=device).to(dtype)
    return q, weights, keys, cands, torch.as_tensor(lengths, dtype=torch.int32, device=device)


LENGTHS = [0, 1, 63, 64, 65, 256, 257, 320, 5]


def test_reference_over_the_page_table_equals_the_gathered_list():
    q, w, keys, cands, lens = _paged_case("cpu", LENGTHS)
    listed = cands.gather(lens)
    assert torch.equal(reference.indexer_logits(q, w, keys, cands, lens),
                       reference.indexer_logits(q, w, keys, listed, lens))
    got, want = (torch.empty(len(LENGTHS), 64, dtype=torch.int32) for _ in range(2))
    reference.indexer_topk(q, w, keys, cands, lens, 64, got)
    reference.indexer_topk(q, w, keys, listed, lens, 64, want)
    assert torch.equal(got, want)
    assert (got[0] == -1).all() and (got[2] >= 0).sum() == 63 and (got[3] >= 0).sum() == 64


@pytest.mark.parametrize("num_heads", [4, 20])
def test_triton_over_the_page_table_equals_its_gathered_list(device, num_heads):
    """The kernel reading the page table computes exactly what it computes from the
    materialized list (the same loads in the same order), and matches the reference."""
    require_triton()
    from dsv4_kernels import indexer

    q, w, keys, cands, lens = _paged_case(device, LENGTHS, NH=num_heads)
    listed = cands.gather(lens)
    got = indexer.indexer_logits(q, w, keys, cands, lens)
    assert torch.equal(got, indexer.indexer_logits(q, w, keys, listed, lens))
    torch.testing.assert_close(got, reference.indexer_logits(q, w, keys, cands, lens), rtol=1e-5, atol=1e-5)
    out, out_listed = (torch.full((len(LENGTHS), 64), 12345, dtype=torch.int32, device=device) for _ in range(2))
    assert indexer.indexer_topk(q, w, keys, cands, lens, 64, out) is out
    indexer.indexer_topk(q, w, keys, listed, lens, 64, out_listed)
    assert torch.equal(out, out_listed)
    _assert_same_selection(out.cpu(), q.cpu(), w.cpu(), keys.cpu(), listed.cpu(), lens.cpu(), 64)


def test_triton_topk_over_the_page_table_equals_the_reference_exactly(device, selection):
    require_triton()
    from dsv4_kernels import indexer

    q, w, keys, cands, lens = _paged_case(device, LENGTHS)
    q, keys = q.round(), keys.round()  # integer scores: exact in fp32, tied often
    w = (w * 8).round() / 2
    out = torch.full((len(LENGTHS), 64), 12345, dtype=torch.int32, device=device)
    indexer.indexer_topk(q, w, keys, cands, lens, 64, out)
    host = PageTableList(cands.rtt.cpu(), cands.rows.cpu(), cands.ratio, cands.width)
    want = reference.indexer_topk(q.cpu(), w.cpu(), keys.cpu(), host, lens.cpu(), 64,
                                  torch.empty(len(LENGTHS), 64, dtype=torch.int32))
    assert torch.equal(_rows_sorted(out.cpu()), _rows_sorted(want))


@pytest.mark.gpu
def test_gpu_page_table_candidates_at_a_long_context():
    """64K-token sequences: 16K candidates per token read from the page table, bit-equal to the
    kernel over the materialized list."""
    T, NH, DI, context, topk = 64, 64, 128, 65536, 512
    lengths = torch.randint(0, context // 4 + 1, (T,)).tolist()
    lengths[:3] = [0, 511, context // 4]
    q, w, keys, cands, lens = _paged_case("cuda", lengths, NH, DI, context, num_rows=4, dtype=torch.bfloat16)
    got = ops.indexer_topk(q, w, keys, cands, lens, topk, torch.empty(T, topk, dtype=torch.int32, device="cuda"))
    want = ops.indexer_topk(q, w, keys, cands.gather(lens), lens, topk,
                            torch.empty(T, topk, dtype=torch.int32, device="cuda"))
    assert torch.equal(got, want)
    assert [int((got[t] >= 0).sum()) for t in range(3)] == [0, 511, 512]


@pytest.mark.gpu
def test_gpu_real_shapes_select_like_reference():
    T, NH, DI, C, topk = 200, 64, 128, 4096, 512
    lengths = torch.randint(0, C + 1, (T,)).tolist()
    lengths[:3] = [0, 511, 512]
    case = _random_case("cuda", T, NH, DI, C, lengths, S=8192, dtype=torch.bfloat16)
    out = torch.empty(T, topk, dtype=torch.int32, device="cuda")
    ops.indexer_topk(*case, topk, out)
    logits = reference.indexer_logits(*case)
    got_logits = ops._kernels("indexer").indexer_logits(*case)
    torch.testing.assert_close(got_logits, logits, rtol=1e-3, atol=1e-3)
    # Compare the picked score sums (bf16 ties may swap near-equal entries).
    for t in range(T):
        picked = out[t][out[t] >= 0]
        assert picked.numel() == min(topk, lengths[t])
    pos = {int(s): j for j, s in enumerate(case[3][5].tolist())}
    picked = torch.tensor([pos[int(s)] for s in out[5] if s >= 0], device="cuda")
    best = logits[5].topk(min(topk, lengths[5])).values.sum()
    torch.testing.assert_close(logits[5][picked].sum(), best, rtol=1e-3, atol=1e-2)
