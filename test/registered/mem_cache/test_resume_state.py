"""A resume from a cached prefix is exact: a request that maps another request's pages for
[0, L) and gets its ResumeState continues with the same logits, bit for bit, as a request
that computed [0, L) itself with the same chunks; on dsv4-tiny and on the conformance-tiny
checkpoint (window 8, so compressed entries carry most of the context, and every cached
prefix is longer than the window: the resumed request's first windows read raw rows of the
prefix from its own window ring). The resumed slot's ring rows (raw window and compressors)
are scribbled over first: whatever the state leaves out is never read. Without the state the
first compressed entries after L differ, and with every part of the state but the window rows
the logits differ (the check can fail)."""

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from dsv4_harness import Session, run_step  # noqa: E402

from sglang.srt.configs.presets import get_preset  # noqa: E402
from sglang.srt.mem_cache.resume_state import (  # noqa: E402
    restore_resume_state, resume_state_bytes, ring_positions_to_keep, take_resume_state, window_positions_to_keep)
from sglang.srt.model_executor.model_runner import ModelRunner  # noqa: E402
from sglang.test.runner_args import cpu_server_args  # noqa: E402

pytestmark = pytest.mark.usefixtures("single_intra_op_thread")
P = 128


@pytest.fixture(scope="module", params=["dsv4-tiny", "conformance-tiny"])
def runner(request, dsv4_reference_dir):
    path = request.param if request.param.startswith("dsv4") else str(dsv4_reference_dir / request.param)
    torch.manual_seed(0)
    return ModelRunner(cpu_server_args(model_path=path, context_length=512, max_total_tokens=4096,
                                       max_running_requests=4, page_size=P))


def _tokens(runner, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, runner.config.vocab_size, (n,), generator=g).tolist()


def _scribble_window(kv_pool, slot, seed=11):
    """Every layer's window ring rows of `slot` filled with finite values no request wrote."""
    g = torch.Generator().manual_seed(seed)
    ring = kv_pool.window_rows(slot, range(kv_pool.window))[0]
    for raw in kv_pool.raw:
        rows = torch.randn((kv_pool.window, kv_pool.config.head_dim), generator=g) * 3
        raw[ring].copy_(kv_pool.encode_kv(rows.to(raw.device, kv_pool.dtype), raw))


def _scribble_rings(kv_pool, slot, seed=7):
    g = torch.Generator().manual_seed(seed)
    for st in list(kv_pool.compressor_state.values()) + list(kv_pool.indexer_state.values()):
        st.kv[slot].copy_(torch.randn(st.kv[slot].shape, generator=g) * 3)
        st.score[slot].copy_(torch.randn(st.score[slot].shape, generator=g) * 3)
    _scribble_window(kv_pool, slot, seed + 1)


def _continue(runner, session, tokens, start, tail):
    """Every row's logits (row k: position start + k) of the tail as one chunk, then of three
    decode steps (so position start + 3, the first ratio-4 emission after start, is a row)."""
    out = [run_step(runner, [session], [tokens[start:start + tail]], return_all_logits=True).next_token_logits]
    for k in range(3):
        p = start + tail + k
        out.append(run_step(runner, [session], [tokens[p:p + 1]]).next_token_logits)
    return torch.cat(out)


@pytest.mark.parametrize("L, chunks", [(P, [P]), (2 * P, [100, 2 * P - 100])])
@pytest.mark.parametrize("tail", [1, 3, 4, 6, 133])
def test_a_resumed_request_continues_bit_for_bit_like_one_that_computed_the_prefix(runner, L, chunks, tail):
    rtp, kv = runner.req_to_token_pool, runner.kv_pool
    tokens = _tokens(runner, L + tail + 3)

    def prefill(session):
        start = 0
        for n in chunks:
            run_step(runner, [session], [tokens[start:start + n]])
            start += n

    owner, computed = Session(runner), Session(runner)
    prefill(owner)
    state = take_resume_state(kv, owner.slot, L)
    prefill(computed)
    expect = _continue(runner, computed, tokens, L, tail)

    resumed = Session(runner)
    _scribble_rings(kv, resumed.slot)
    rtp.map_cached_prefix(resumed.slot, rtp.pages_of(owner.slot)[:L // P])
    restore_resume_state(kv, resumed.slot, state)
    resumed.length = L
    owner.release()  # the resumed request still holds the shared pages
    assert all(rtp.pages.refcount(p) == 1 for p in rtp.pages_of(resumed.slot)[:L // P])
    got = _continue(runner, resumed, tokens, L, tail)
    torch.testing.assert_close(got, expect, atol=0, rtol=0)

    # every part of the state but the window rows: the first windows after L read the slot's
    # stale ring rows for positions [L - W, L), and the logits differ from the first row on
    assert L > runner.config.sliding_window
    no_window = Session(runner)
    _scribble_rings(kv, no_window.slot)
    rtp.map_cached_prefix(no_window.slot, rtp.pages_of(resumed.slot)[:L // P])
    restore_resume_state(kv, no_window.slot, state)
    _scribble_window(kv, no_window.slot)
    no_window.length = L
    wrong = _continue(runner, no_window, tokens, L, tail)
    assert (wrong[0] - expect[0]).abs().max() > 1e-3
    no_window.release()

    # the same without the state: the first ratio-4 entries after L (compressor and indexer
    # key, emitted at position L + 3) pool scribbled ring rows; with the state they are exact
    stale = Session(runner)
    _scribble_rings(kv, stale.slot)
    rtp.map_cached_prefix(stale.slot, rtp.pages_of(resumed.slot)[:L // P])
    stale.length = L
    _continue(runner, stale, tokens, L, tail)
    entry = {s: int(rtp.req_to_token[s.slot, L + 3]) // 4 for s in (computed, resumed, stale)}
    c4 = [layer for layer in kv.compressed if runner.config.layer_compress_ratio(layer) == 4]
    assert c4 and kv.indexer_keys
    for pools in (kv.compressed, kv.indexer_keys):
        for layer in c4:
            pool = pools[layer]
            assert torch.equal(pool[entry[resumed]], pool[entry[computed]]), layer
            assert (pool[entry[stale]].float() - pool[entry[computed]].float()).abs().max() > 1e-3, layer
    for s in (computed, resumed, stale):
        s.release()
    assert rtp.num_free_pages == rtp.pages.capacity


def test_the_state_holds_exactly_the_ratio_4_rings_last_block():
    assert list(ring_positions_to_keep(256, 4)) == [252, 253, 254, 255]
    assert list(ring_positions_to_keep(256, 128)) == []
    assert list(ring_positions_to_keep(130, 4)) == [124, 125, 126, 127, 128, 129]
    assert list(ring_positions_to_keep(130, 128)) == [128, 129]
    assert list(ring_positions_to_keep(2, 4)) == [0, 1]


def test_the_state_holds_the_window_rows_of_the_last_w_positions_at_their_ring_rows(runner):
    """Taken at a length that wraps the ring (133 = 16 x 8 + 5 with W = 8): the rows of
    positions 125..132, in position order, from ring offsets 5..7 then 0..4 on every layer;
    restored into another slot at the same offsets, leaving its other rows alone."""
    kv = runner.kv_pool
    W = kv.window
    assert W == 8 and list(window_positions_to_keep(133, W)) == list(range(125, 133))
    assert list(window_positions_to_keep(5, W)) == [0, 1, 2, 3, 4]
    assert kv.window_rows(1, range(125, 133)) == [slice(8 + 5, 8 + 8), slice(8 + 0, 8 + 5)]
    with pytest.raises(ValueError, match="at most 8 consecutive positions"):
        kv.window_rows(1, range(0, 9))
    with pytest.raises(ValueError, match="has no window ring"):
        kv.window_rows(runner.req_to_token_pool.padding_slot, range(0, 1))
    _scribble_rings(kv, 1, seed=3)
    _scribble_rings(kv, 2, seed=4)
    state = take_resume_state(kv, 1, 133)
    assert state.window.shape[:2] == (len(kv.raw), W)
    for layer, raw in enumerate(kv.raw):
        assert torch.equal(state.window[layer], torch.cat([raw[8 + 5:8 + 8], raw[8:8 + 5]]))
    short = take_resume_state(kv, 1, 5)  # shorter than the window: positions 0..4 only
    assert short.window.shape[:2] == (len(kv.raw), 5)
    other = [raw[2 * W:3 * W].clone() for raw in kv.raw]
    restore_resume_state(kv, 2, short)
    for layer, raw in enumerate(kv.raw):
        assert torch.equal(raw[2 * W:2 * W + 5], raw[W:W + 5])
        assert torch.equal(raw[2 * W + 5:3 * W], other[layer][5:])
    restore_resume_state(kv, 2, state)
    for raw in kv.raw:
        assert torch.equal(raw[2 * W:3 * W], raw[W:2 * W])
    with pytest.raises(ValueError, match="another pool layout"):
        restore_resume_state(kv, 2, dataclasses.replace(state, length=132))


def test_resume_state_bytes_match_a_taken_state_and_the_flash_figure(runner):
    kv = runner.kv_pool
    state = take_resume_state(kv, 0, P)
    assert state.nbytes == resume_state_bytes(runner.config, P, kv.dtype, kv.kv_cache_dtype) > 0
    assert state.window.numel() * state.window.element_size() == kv.raw[0][:kv.window].nbytes * len(kv.raw)
    flash = get_preset("dsv4-flash")
    n_c4 = sum(flash.layer_compress_ratio(i) == 4 for i in range(flash.num_hidden_layers))
    # the window rows: 128 positions x 43 layers x a 584 B FP8 row; per ratio-4 layer: 4
    # positions x (kv, score) x 2 * dim fp32, compressor (512) + indexer (128)
    rings = n_c4 * 4 * 2 * 2 * (512 + 128) * 4
    assert resume_state_bytes(flash, 256, torch.bfloat16, "fp8_e4m3") == 43 * 128 * 584 + rings == 4074496
    assert resume_state_bytes(flash, 256, torch.bfloat16) == 43 * 128 * 1024 + rings
    with pytest.raises(ValueError, match="positive length"):
        take_resume_state(runner.kv_pool, 0, 0)


@pytest.mark.gpu
def test_on_cuda_a_state_lives_in_pinned_host_memory_and_restores_the_rows():
    from sglang.srt.mem_cache.dsv4_kv_pool import DSV4KVPool

    config = get_preset("dsv4-tiny")
    kv = DSV4KVPool(config, 4 * P, 2, torch.bfloat16, "cuda", max_step_tokens=P)
    _scribble_rings(kv, 0, seed=1)
    _scribble_rings(kv, 1, seed=2)
    state = take_resume_state(kv, 0, 2 * P)
    assert state.rings and all(t.device.type == "cpu" and t.is_pinned()
                               for _, a, b in state.rings.values() for t in (a, b))
    assert state.window.device.type == "cpu" and state.window.is_pinned()
    restore_resume_state(kv, 1, state)
    torch.cuda.synchronize()
    W = kv.window
    assert all(torch.equal(raw[W:2 * W], raw[:W]) for raw in kv.raw)
    for st in list(kv.compressor_state.values()) + list(kv.indexer_state.values()):
        rows = [q % st.ring for q in ring_positions_to_keep(2 * P, st.ratio)]
        assert torch.equal(st.kv[1, rows], st.kv[0, rows]) and torch.equal(st.score[1, rows], st.score[0, rows])
