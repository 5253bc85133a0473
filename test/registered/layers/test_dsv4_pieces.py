"""DSV4 model pieces against plain references written out here: Sinkhorn, the compressors
(emission timing and the ratio-4 block overlap), the indexer's top-k, attention with a sink,
RoPE / YaRN, and the MoE router (hash tables, selection bias, duplicate experts)."""

import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from dsv4_harness import Session, run_step  # noqa: E402

from sglang.srt.configs.presets import get_preset  # noqa: E402
from dsv4_kernels import reference  # noqa: E402
from sglang.srt.layers.mhc import sinkhorn_split  # noqa: E402
from sglang.srt.layers.moe.experts import RoutedExperts  # noqa: E402
from sglang.srt.layers.moe.router import Gate, route  # noqa: E402
from sglang.srt.layers.rotary_embedding import RotaryTable, apply_rope_, yarn_inv_freq  # noqa: E402
from sglang.srt.model_executor.model_runner import ModelRunner  # noqa: E402
from sglang.srt.models.deepseek_v4 import rope_tables_for  # noqa: E402
from sglang.test.runner_args import cpu_server_args  # noqa: E402


def compressor_pool(state_kv, state_sc, kv_new, sc_new, gather, ratio):
    """The model's pooling (sgl-kernel's torch reference) as a function."""
    D = kv_new.shape[-1] // (2 if ratio == 4 else 1)
    out = kv_new.new_empty(gather.shape[0], D)
    return reference.compressor_pool(state_kv, state_sc, kv_new, sc_new, gather, ratio, out)


def indexer_topk(q, w, keys, cand_slots, cand_len, topk):
    """The model's indexer top-k (sgl-kernel's torch reference) as a function."""
    out = torch.empty(cand_slots.shape[0], topk, dtype=torch.int32)
    return reference.indexer_topk(q, w, keys, cand_slots, cand_len, topk, out)


pytestmark = pytest.mark.usefixtures("single_intra_op_thread")


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# ---- mHC Sinkhorn ---------------------------------------------------------------------------


# The conformance checkpoint's hc_*_scale are ~0.36-0.51 and its mixes have std ~1, so comb
# logits have a spread of ~0.5: 20 iterations converge there. With much larger spreads 20
# iterations end on an exact column normalisation with rows still off (as in the reference).
@pytest.mark.parametrize("comb_scale,iters", [(0.36, 20), (0.6, 20), (2.0, 200)])
def test_sinkhorn_comb_is_doubly_stochastic(comb_scale, iters):
    hc, T = 4, 256
    g = _gen(0)
    mixes = torch.randn(T, (2 + hc) * hc, generator=g)
    scale = torch.tensor([0.44, 0.5, comb_scale])
    base = torch.randn((2 + hc) * hc, generator=g) * 0.1
    pre, post, comb = sinkhorn_split(mixes, scale, base, hc, iters=iters, eps=1e-6)
    assert comb.shape == (T, hc, hc) and pre.shape == (T, hc) and post.shape == (T, hc)
    ones = torch.ones(T, hc)
    torch.testing.assert_close(comb.sum(dim=-1), ones, atol=1e-5, rtol=0)  # rows
    torch.testing.assert_close(comb.sum(dim=-2), ones, atol=1e-5, rtol=0)  # columns
    assert (comb > 0).all()
    torch.testing.assert_close(pre, torch.sigmoid(mixes[:, :hc] * scale[0] + base[:hc]) + 1e-6)
    torch.testing.assert_close(post, 2 * torch.sigmoid(mixes[:, hc:2 * hc] * scale[1] + base[hc:2 * hc]))


def _sinkhorn_reference(logits, iters, eps):
    """The mHC Sinkhorn in plain Python: softmax rows + eps, normalise columns, then (iters - 1) x
    (rows, columns), each divide by sum + eps."""
    n = len(logits)
    m = []
    for row in logits:
        e = [math.exp(v - max(row)) for v in row]
        m.append([v / sum(e) + eps for v in e])

    def cols(m):
        sums = [sum(m[i][j] for i in range(n)) for j in range(n)]
        return [[m[i][j] / (sums[j] + eps) for j in range(n)] for i in range(n)]

    def rows(m):
        return [[v / (sum(r) + eps) for v in r] for r in m]

    m = cols(m)
    for _ in range(iters - 1):
        m = cols(rows(m))
    return m


@pytest.mark.parametrize("spread", [0.5, 3.0])
def test_sinkhorn_matches_the_reference_iteration(spread):
    hc = 4
    g = _gen(4)
    mixes = torch.randn(8, (2 + hc) * hc, generator=g, dtype=torch.float64) * spread
    base = torch.randn((2 + hc) * hc, generator=g, dtype=torch.float64) * 0.1
    scale = torch.tensor([0.5, 0.5, 0.9], dtype=torch.float64)
    _, _, comb = sinkhorn_split(mixes, scale, base, hc, iters=20, eps=1e-6)
    logits = (mixes[:, 2 * hc:] * scale[2] + base[2 * hc:]).view(8, hc, hc)
    for t in range(8):
        ref = torch.tensor(_sinkhorn_reference(logits[t].tolist(), 20, 1e-6), dtype=torch.float64)
        torch.testing.assert_close(comb[t], ref, atol=1e-12, rtol=1e-10)


def test_sinkhorn_single_iteration_is_row_softmax_then_column_normalisation():
    hc = 4
    g = _gen(1)
    mixes = torch.randn(3, (2 + hc) * hc, generator=g)
    scale, base = torch.ones(3), torch.zeros((2 + hc) * hc)
    _, _, comb = sinkhorn_split(mixes, scale, base, hc, iters=1, eps=0.0)
    soft = mixes[:, 2 * hc:].view(3, hc, hc).softmax(-1)
    torch.testing.assert_close(comb, soft / soft.sum(dim=-2, keepdim=True))


# ---- compressor -----------------------------------------------------------------------------


def _softmax_pool_reference(rows_kv, rows_score):
    """rows_*: lists (one per source row) of per-channel lists -> pooled per-channel list."""
    out = []
    for c in range(len(rows_kv[0])):
        s = [r[c] for r in rows_score]
        m = max(s)
        w = [math.exp(v - m) for v in s]
        out.append(sum(wi * r[c] for wi, r in zip(w, rows_kv)) / sum(w))
    return out


def test_compressor_pool_ratio4_block0_overlap_and_ring_sources():
    """Ratio 4: entry i pools block i through channels [D:2D] and block i-1 through [0:D]; for
    entry 0 the block -1 half contributes nothing (entry 0 = pooling of block 0 alone)."""
    D, C, R = 3, 6, 8
    g = _gen(2)
    kv_new, sc_new = torch.randn(8, C, generator=g), torch.randn(8, C, generator=g)
    rows = 2
    state_kv, state_sc = torch.randn(rows, R, C, generator=g), torch.randn(rows, R, C, generator=g)
    state_sc[0, 5] = float("-inf")  # a ring row never written
    fresh = lambda j: -j - 2  # noqa: E731
    gather = torch.tensor([
        [-1, -1, -1, -1] + [fresh(j) for j in range(4)],  # entry 0: block -1 empty, block 0 fresh
        [fresh(j) for j in range(8)],  # entry 1: blocks 0 and 1 fresh
        [1 * R + 4, 1 * R + 5, 1 * R + 6, 1 * R + 7] + [fresh(j) for j in range(4, 8)],  # block i-1 from ring
    ], dtype=torch.int32)
    out = compressor_pool(state_kv, state_sc, kv_new, sc_new, gather, ratio=4)
    assert out.shape == (3, D)

    flat_kv, flat_sc = state_kv.reshape(-1, C), state_sc.reshape(-1, C)

    def src(idx):
        if idx >= 0:
            return flat_kv[idx].tolist(), flat_sc[idx].tolist()
        return kv_new[-idx - 2].tolist(), sc_new[-idx - 2].tolist()

    for e in range(3):
        kv_rows, sc_rows = [], []
        for j, idx in enumerate(gather[e].tolist()):
            if idx == -1:
                continue
            kv, sc = src(idx)
            half = slice(0, D) if j < 4 else slice(D, C)
            kv_rows.append(kv[half])
            sc_rows.append(sc[half])
        expect = torch.tensor(_softmax_pool_reference(kv_rows, sc_rows))
        torch.testing.assert_close(out[e], expect, atol=1e-6, rtol=1e-6, msg=f"entry {e}")

    # entry 0 is exactly block 0 pooled alone, whatever the block -1 sources would hold
    alone = compressor_pool(state_kv, state_sc, kv_new, sc_new, gather[:1], ratio=4)
    block0 = (kv_new[:4, D:] * sc_new[:4, D:].softmax(dim=0)).sum(0)
    torch.testing.assert_close(alone[0], block0, atol=1e-6, rtol=1e-6)


def test_compressor_pool_ratio128_is_per_channel_softmax_over_the_block():
    C, R = 2, 128
    g = _gen(3)
    kv_new, sc_new = torch.randn(R, C, generator=g), torch.randn(R, C, generator=g) * 3
    state_kv, state_sc = torch.randn(1, R, C, generator=g), torch.randn(1, R, C, generator=g)
    # first 100 rows from the ring, last 28 fresh (a block split across two steps)
    gather = torch.tensor([list(range(100)) + [-j - 2 for j in range(100, 128)]], dtype=torch.int32)
    out = compressor_pool(state_kv, state_sc, kv_new, sc_new, gather, ratio=128)
    kv_rows = state_kv[0, :100].tolist() + kv_new[100:].tolist()
    sc_rows = state_sc[0, :100].tolist() + sc_new[100:].tolist()
    torch.testing.assert_close(out[0], torch.tensor(_softmax_pool_reference(kv_rows, sc_rows)), atol=1e-6, rtol=1e-6)


def _tiny_runner(**kw):
    return ModelRunner(cpu_server_args(model_path="dsv4-tiny", dtype="float32", device="cpu",
                                       context_length=512, max_total_tokens=1024, max_running_requests=4, **kw))


def _tokens(n, seed=5):
    return torch.randint(2, 512, (n,), generator=_gen(seed)).tolist()


def _entry_slot(runner, session, i, ratio):
    """Pool row of compressed entry i: derived from the raw slot of the block's last token."""
    return int(runner.req_to_token_pool.req_to_token[session.slot, (i + 1) * ratio - 1]) // ratio


def _written_rows(pool):
    return set((pool.abs().sum(dim=-1) > 0).nonzero().flatten().tolist())


def _compressed_pools(runner):
    """(description, ratio, pool) for every compressed pool of dsv4-tiny (ratios 0, 4, 128, 4)."""
    kv = runner.kv_pool
    return [("c4 layer 1", 4, kv.compressed[1]), ("c4 layer 3", 4, kv.compressed[3]),
            ("indexer keys layer 1", 4, kv.indexer_keys[1]), ("indexer keys layer 3", 4, kv.indexer_keys[3]),
            ("c128 layer 2", 128, kv.compressed[2])]


def test_compressed_entries_appear_exactly_when_their_block_ends():
    runner = _tiny_runner()
    toks = _tokens(260)
    # token by token across several c4 blocks, then chunks whose ends sit next to the c128 ends
    sizes = [1] * 24 + [102, 1, 1, 1, 125, 1, 1, 4]
    assert sum(sizes) == 260
    s = Session(runner)
    snapshots = {}
    n = 0
    for size in sizes:
        run_step(runner, [s], [toks[n:n + size]])
        n += size
        for name, r, pool in _compressed_pools(runner):
            expect_rows = {_entry_slot(runner, s, i, r) for i in range(n // r)}
            assert _written_rows(pool) == expect_rows, f"{name} after {n} tokens"
            for row in expect_rows:  # an entry, once emitted, never changes
                key = (name, row)
                if key in snapshots:
                    assert torch.equal(pool[row], snapshots[key]), f"{name} row {row} changed at {n} tokens"
                else:
                    snapshots[key] = pool[row].clone()
    assert n // 128 == 2 and len([k for k in snapshots if k[0] == "c128 layer 2"]) == 2
    s.release()


def _rope_reference(x, cos, sin):
    """Rotate pairs (2k, 2k+1) of the last 2*cos.shape[-1] dims as complex numbers."""
    rd = cos.shape[-1] * 2
    z = torch.view_as_complex(x[..., -rd:].double().contiguous().unflatten(-1, (-1, 2)))
    rot = torch.complex(cos.double(), sin.double())
    out = x.double().clone()
    out[..., -rd:] = torch.view_as_real(z * rot).flatten(-2)
    return out.float()


def _compressor_reference(comp, x, ratio, rope):
    """Entries of a whole sequence by the compressor's definition, block by block in plain loops."""
    kv = x.double() @ comp.wkv.weight.double().T
    pos = torch.arange(x.shape[0])
    score = x.double() @ comp.wgate.weight.double().T + comp.ape.double()[pos % ratio]
    D = kv.shape[1] // (2 if ratio == 4 else 1)
    entries = []
    for i in range(x.shape[0] // ratio):
        blk = slice(i * ratio, (i + 1) * ratio)
        if ratio == 4:
            kv_rows, sc_rows = [kv[blk, D:]], [score[blk, D:]]
            if i > 0:
                prev = slice((i - 1) * ratio, i * ratio)
                kv_rows.insert(0, kv[prev, :D])
                sc_rows.insert(0, score[prev, :D])
            k, s = torch.cat(kv_rows), torch.cat(sc_rows)
        else:
            k, s = kv[blk], score[blk]
        pooled = (k * s.softmax(dim=0)).sum(0)
        normed = comp.norm.weight.double() * pooled / torch.sqrt(pooled.square().mean() + comp.norm.eps)
        entries.append(normed.float())
    e = torch.stack(entries)
    positions = torch.arange(len(entries)) * ratio
    return _rope_reference(e, rope.cos[positions], rope.sin[positions])


def test_compressor_entries_match_the_block_pooling_reference():
    """Pool rows after a full prefill equal the entries computed by hand from the compressor's
    inputs, for the c4 and c128 compressors and the indexer's key compressor."""
    runner = _tiny_runner()
    model = runner.model
    layers = {1: model.layers[1].attn, 2: model.layers[2].attn}
    captured = {}

    def hook(name):
        def fn(module, args):
            captured[name] = args[0].detach().clone()
        return fn

    handles = [layers[1].compressor.register_forward_pre_hook(hook("c4")),
               layers[1].indexer.compressor.register_forward_pre_hook(hook("idx")),
               layers[2].compressor.register_forward_pre_hook(hook("c128"))]
    toks = _tokens(270, seed=6)
    s = Session(runner)
    run_step(runner, [s], [toks])
    for h in handles:
        h.remove()
    kv = runner.kv_pool
    cases = [("c4", layers[1].compressor, 4, kv.compressed[1], layers[1].rope),
             ("idx", layers[1].indexer.compressor, 4, kv.indexer_keys[1], layers[1].rope),
             ("c128", layers[2].compressor, 128, kv.compressed[2], layers[2].rope)]
    for name, comp, r, pool, rope in cases:
        x = captured[name]
        assert x.shape[0] == 270
        expect = _compressor_reference(comp, x, r, rope)
        rows = [_entry_slot(runner, s, i, r) for i in range(270 // r)]
        torch.testing.assert_close(pool[rows], expect, atol=1e-5, rtol=1e-5, msg=name)
    s.release()


# ---- indexer top-k --------------------------------------------------------------------------


def _topk_reference(q, w, keys, cand_slots, cand_len, topk):
    out = []
    for t in range(q.shape[0]):
        scored = []
        for c in range(int(cand_len[t])):
            slot = int(cand_slots[t, c])
            score = 0.0
            for h in range(q.shape[1]):
                score += float(w[t, h]) * max(0.0, float(q[t, h] @ keys[slot]))
            scored.append((score, slot))
        scored.sort(reverse=True)
        out.append({slot for _, slot in scored[:topk]})
    return out


def test_indexer_topk_equals_brute_force_including_short_lists_and_padding():
    T, nH, Di, S, C, topk = 7, 3, 5, 40, 10, 4
    g = _gen(7)
    q = torch.randn(T, nH, Di, generator=g)
    w = torch.randn(T, nH, generator=g)
    keys = torch.randn(S, Di, generator=g)
    cand_len = torch.tensor([0, 1, 3, 4, 5, 9, 10], dtype=torch.int32)
    cand_slots = torch.full((T, C), -1, dtype=torch.int32)
    for t in range(T):
        n = int(cand_len[t])
        cand_slots[t, :n] = torch.randperm(S, generator=g)[:n].int()
    cand_slots[5, 9] = 39  # a real slot beyond cand_len: must be ignored
    got = indexer_topk(q, w, keys, cand_slots, cand_len, topk)
    assert got.shape == (T, topk)
    ref = _topk_reference(q, w, keys, cand_slots, cand_len, topk)
    for t in range(T):
        k = min(topk, int(cand_len[t]))
        row = got[t].tolist()
        assert set(row[:k]) == ref[t], f"token {t}"
        assert row[k:] == [-1] * (topk - k), f"token {t}: padding"


def test_indexer_topk_with_fewer_candidate_columns_than_topk():
    g = _gen(8)
    q, w, keys = torch.randn(2, 2, 4, generator=g), torch.rand(2, 2, generator=g), torch.randn(6, 4, generator=g)
    cand_slots = torch.tensor([[3, 5], [2, -1]], dtype=torch.int32)
    cand_len = torch.tensor([2, 1], dtype=torch.int32)
    got = indexer_topk(q, w, keys, cand_slots, cand_len, 4)
    assert got.shape == (2, 4)
    assert sorted(got[0, :2].tolist()) == [3, 5] and got[0, 2:].tolist() == [-1, -1]
    assert got[1].tolist() == [2, -1, -1, -1]


# ---- attention with a sink ------------------------------------------------------------------


def _attention_reference(q, kv_a, idx_a, len_a, kv_b, idx_b, len_b, sink, scale):
    T, H, D = q.shape
    out = torch.zeros(T, H, D, dtype=torch.float64)
    for t in range(T):
        keys = []
        for kv, idx, ln in ((kv_a, idx_a, len_a), (kv_b, idx_b, len_b)):
            if kv is None:
                continue
            for j in range(int(ln[t])):
                if int(idx[t, j]) >= 0:
                    keys.append(kv[int(idx[t, j])].double())
        for h in range(H):
            if not keys:
                continue  # only the sink: output zero
            s = [float(q[t, h].double() @ k) * scale for k in keys]
            m = max(max(s), float(sink[h]))
            e = [math.exp(v - m) for v in s]
            denom = sum(e) + math.exp(float(sink[h]) - m)
            out[t, h] = sum(ei / denom * k for ei, k in zip(e, keys))
    return out.float()


def sparse_attention_with_sink(q, *args):
    """The attention core the torch backend runs (sgl-kernel's reference), as a function."""
    from dsv4_kernels import reference

    return reference.sparse_attn_with_sink(q, *args, out=torch.empty_like(q))


def test_sparse_attention_with_sink_equals_naive_softmax():
    T, H, D, S = 5, 3, 8, 30
    g = _gen(9)
    q = torch.randn(T, H, D, generator=g)
    kv_a, kv_b = torch.randn(S, D, generator=g), torch.randn(12, D, generator=g)
    sink = torch.randn(H, generator=g)
    idx_a = torch.tensor([[0, 1, 2, -1], [3, -1, 4, 5], [6, 7, 8, 9], [-1, -1, -1, -1], [10, 10, 11, 29]],
                         dtype=torch.int32)
    len_a = torch.tensor([3, 4, 2, 0, 4], dtype=torch.int32)  # row 2: entries beyond len ignored
    idx_b = torch.tensor([[0, -1], [1, 2], [-1, -1], [-1, -1], [3, 3]], dtype=torch.int32)
    len_b = torch.tensor([1, 2, 0, 0, 2], dtype=torch.int32)  # duplicates count twice (no de-dup)
    scale = D ** -0.5
    got = sparse_attention_with_sink(q, kv_a, idx_a, len_a, kv_b, idx_b, len_b, sink, scale)
    ref = _attention_reference(q, kv_a, idx_a, len_a, kv_b, idx_b, len_b, sink, scale)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[3], torch.zeros(H, D))  # empty list -> zeros
    # window only (no compressed list)
    got_a = sparse_attention_with_sink(q, kv_a, idx_a, len_a, None, None, None, sink, scale)
    ref_a = _attention_reference(q, kv_a, idx_a, len_a, None, None, None, sink, scale)
    torch.testing.assert_close(got_a, ref_a, atol=1e-5, rtol=1e-5)


def test_sink_takes_probability_mass_from_the_keys():
    q = torch.ones(1, 2, 4)
    kv = torch.ones(1, 4)
    idx, ln = torch.tensor([[0]], dtype=torch.int32), torch.tensor([1], dtype=torch.int32)
    sink = torch.tensor([-1e4, 1.0])
    # score = 4 * 0.5 = 2: head 0 puts all mass on the key; head 1 gives e^1/(e^2+e^1) to the sink
    out = sparse_attention_with_sink(q, kv, idx, ln, None, None, None, sink, 0.5)
    torch.testing.assert_close(out[0, 0], torch.ones(4))
    torch.testing.assert_close(out[0, 1], torch.full((4,), math.e ** 2 / (math.e ** 2 + math.e)))


# ---- RoPE / YaRN ----------------------------------------------------------------------------


def test_rope_is_interleaved_pairs_and_inverse_undoes_it():
    T, H, D, rd = 6, 3, 24, 16
    table = RotaryTable(rd, 64, 10000.0)
    pos = torch.tensor([0, 1, 5, 17, 40, 63])
    cos, sin = table.lookup(pos)
    x = torch.randn(T, H, D, generator=_gen(10))
    y = apply_rope_(x.clone(), cos, sin)
    torch.testing.assert_close(y, _rope_reference(x, cos[:, None], sin[:, None]), atol=1e-5, rtol=1e-5)
    assert torch.equal(y[..., :D - rd], x[..., :D - rd])  # nope dims untouched
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), atol=1e-5, rtol=1e-5)
    pairs_x, pairs_y = x[..., D - rd:].unflatten(-1, (-1, 2)), y[..., D - rd:].unflatten(-1, (-1, 2))
    torch.testing.assert_close(pairs_y.norm(dim=-1), pairs_x.norm(dim=-1), atol=1e-5, rtol=1e-5)
    assert torch.equal(y[0], x[0])  # position 0 is the identity
    back = apply_rope_(y.clone(), cos, sin, inverse=True)
    torch.testing.assert_close(back, x, atol=1e-5, rtol=1e-5)
    # the angle of pair k at position p is p * theta^(-2k/rd)
    inv = 1.0 / (10000.0 ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd))
    torch.testing.assert_close(table.cos.double(), torch.outer(torch.arange(64.0, dtype=torch.float64), inv).cos(),
                               atol=1e-6, rtol=0)


def test_rope_on_a_single_vector_in_place():
    kv = torch.randn(4, 10, generator=_gen(11))
    table = RotaryTable(4, 16, 160000.0, 4.0, 8, 32, 1)
    cos, sin = table.lookup(torch.tensor([3, 4, 9, 15]))
    before = kv.clone()
    ret = apply_rope_(kv, cos, sin)
    assert ret is kv and not torch.equal(kv, before)
    apply_rope_(kv, cos, sin, inverse=True)
    torch.testing.assert_close(kv, before, atol=1e-6, rtol=1e-6)


def _yarn_reference(dim, base, factor, orig, beta_fast, beta_slow):
    """DeepSeek's find_correction_range + linear ramp, written out per dimension."""
    def corr(rot):
        return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))
    low, high = max(math.floor(corr(beta_fast)), 0), min(math.ceil(corr(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    out = []
    for k in range(dim // 2):
        f = 1.0 / base ** (2 * k / dim)
        ramp = min(max((k - low) / (high - low), 0.0), 1.0)
        out.append(f / factor * ramp + f * (1 - ramp))
    return torch.tensor(out), low, high


def test_yarn_frequencies():
    dim, base = 64, 160000.0
    plain = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    torch.testing.assert_close(yarn_inv_freq(dim, base, 16.0, 0, 32, 1).double(), plain, rtol=1e-6, atol=0)
    yarn = yarn_inv_freq(dim, base, 16.0, 4096, 32, 1).double()
    ref, low, high = _yarn_reference(dim, base, 16.0, 4096, 32, 1)
    torch.testing.assert_close(yarn, ref.double(), rtol=1e-6, atol=0)
    assert 0 < low < high < dim // 2 - 1  # some dims on each side of the ramp
    torch.testing.assert_close(yarn[:low + 1], plain[:low + 1], rtol=1e-6, atol=0)  # high freq unchanged
    hi = math.ceil(high)
    torch.testing.assert_close(yarn[hi:], plain[hi:] / 16.0, rtol=1e-6, atol=0)  # low freq interpolated fully


def test_layers_use_plain_rope_uncompressed_and_yarn_compressed():
    c = get_preset("dsv4-tiny")
    plain = rope_tables_for(c, c.max_position_embeddings)["plain"]
    yarn = rope_tables_for(c, c.max_position_embeddings)["yarn"]
    inv_plain = yarn_inv_freq(c.qk_rope_head_dim, c.rope_theta, 1.0, 0, 32, 1)
    inv_yarn = yarn_inv_freq(c.qk_rope_head_dim, c.compress_rope_theta, c.rope_factor,
                             c.original_max_position_embeddings, c.beta_fast, c.beta_slow)
    torch.testing.assert_close(plain.cos[100], (100 * inv_plain).cos())
    torch.testing.assert_close(yarn.cos[100], (100 * inv_yarn).cos())
    assert not torch.allclose(plain.cos[100], yarn.cos[100])


# ---- MoE routing ----------------------------------------------------------------------------


def _sqrt_softplus(v):
    return math.sqrt(math.log1p(math.exp(v)))


def test_selection_bias_changes_selection_but_weights_are_unbiased_scores():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    s = [_sqrt_softplus(v) for v in logits[0].tolist()]
    w0, ids0 = route(logits, 2, 1.5, "sqrtsoftplus")
    assert sorted(ids0[0].tolist()) == [0, 1]
    bias = torch.tensor([0.0, 0.0, 5.0, 0.0])
    w, ids = route(logits, 2, 1.5, "sqrtsoftplus", bias=bias)
    assert sorted(ids[0].tolist()) == [0, 2]  # the bias pulled expert 2 in
    expect = {0: s[0] / (s[0] + s[2]) * 1.5, 2: s[2] / (s[0] + s[2]) * 1.5}
    for e, wt in zip(ids[0].tolist(), w[0].tolist()):
        assert wt == pytest.approx(expect[e], rel=1e-6)
    assert w[0].sum().item() == pytest.approx(1.5, rel=1e-6)
    for e, wt in zip(ids0[0].tolist(), w0[0].tolist()):
        assert wt == pytest.approx(s[e] / (s[0] + s[1]) * 1.5, rel=1e-6)


def test_hash_layers_route_by_the_table():
    g = _gen(12)
    vocab, E, k = 20, 8, 2
    table = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(vocab)]).int()
    input_ids = torch.tensor([3, 7, 3, 19, 0])
    logits = torch.randn(5, E, generator=g)
    w, ids = route(logits, k, 2.0, "sqrtsoftplus", tid2eid=table, input_ids=input_ids)
    assert torch.equal(ids, table[input_ids].long())
    scores = F.softplus(logits).sqrt()
    sel = scores.gather(1, ids)
    torch.testing.assert_close(w, sel / sel.sum(-1, keepdim=True) * 2.0)
    # the model's hash layer: Gate with a table, no bias; later layers have a bias, no table
    model = _tiny_runner().model
    gate0, gate1 = model.layers[0].ffn.gate, model.layers[1].ffn.gate
    assert isinstance(gate0, Gate) and gate0.tid2eid is not None and gate0.bias is None
    assert gate1.tid2eid is None and gate1.bias is not None
    x = torch.randn(5, model.config.hidden_size, generator=g)
    ids_model = torch.tensor([5, 9, 5, 100, 511])
    _, got = gate0(x, ids_model)
    assert torch.equal(got, gate0.tid2eid[ids_model].long())


def test_an_expert_listed_twice_by_a_hash_table_contributes_once():
    g = _gen(13)
    E, d, inter, limit = 4, 6, 5, 1.0
    experts = RoutedExperts(E, d, inter, limit, torch.float32)
    for p in (experts.w1, experts.w2, experts.w3):
        p.copy_(torch.randn(p.shape, generator=g))
    x = torch.randn(2, d, generator=g) * 3  # large enough that the clamps engage
    table = torch.tensor([[2, 2], [1, 3]], dtype=torch.int32)
    logits = torch.randn(2, E, generator=g)
    w, ids = route(logits, 2, 1.5, "sqrtsoftplus", tid2eid=table, input_ids=torch.tensor([0, 1]))
    assert w[0].tolist() == pytest.approx([0.75, 0.75])  # s/(2s) * 1.5 each
    out = experts(x, w, ids)

    def expert(e, v, weight):
        gate = (experts.w1[e] @ v).clamp(max=limit)
        up = (experts.w3[e] @ v).clamp(-limit, limit)
        return experts.w2[e] @ (F.silu(gate) * up * weight)

    assert ((experts.w1[2] @ x[0]).abs() > limit).any()  # the clamp matters for this input
    torch.testing.assert_close(out[0], expert(2, x[0], 0.75), atol=1e-5, rtol=1e-5)  # once, not twice
    torch.testing.assert_close(out[1], expert(1, x[1], w[1, 0]) + expert(3, x[1], w[1, 1]), atol=1e-5, rtol=1e-5)
