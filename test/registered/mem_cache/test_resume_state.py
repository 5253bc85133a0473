"""A resume from a cached prefix is exact: a request that maps another request's pages for
[0, L) and gets its ResumeState continues with the same logits, bit for bit, as a request
that computed [0, L) itself with the same chunks; on dsv4-tiny and on the conformance-tiny
checkpoint (window 8, so compressed entries carry most of the context). The resumed slot's
ring rows are scribbled over first: whatever the state leaves out is never read. Without the
state the first compressed entries after L differ (the check can fail)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from dsv4_harness import Session, run_step  # noqa: E402

from sglang.srt.configs.presets import get_preset  # noqa: E402
from sglang.srt.mem_cache.resume_state import (  # noqa: E402
    restore_resume_state, resume_state_bytes, ring_positions_to_keep, take_resume_state)
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


def _scribble_rings(kv_pool, slot, seed=7):
    g = torch.Generator().manual_seed(seed)
    for st in list(kv_pool.compressor_state.values()) + list(kv_pool.indexer_state.values()):
        st.kv[slot].copy_(torch.randn(st.kv[slot].shape, generator=g) * 3)
        st.score[slot].copy_(torch.randn(st.score[slot].shape, generator=g) * 3)


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


def test_resume_state_bytes_match_a_taken_state_and_the_flash_figure(runner):
    state = take_resume_state(runner.kv_pool, 0, P)
    assert state.nbytes == resume_state_bytes(runner.config, P) > 0
    flash = get_preset("dsv4-flash")
    n_c4 = sum(flash.layer_compress_ratio(i) == 4 for i in range(flash.num_hidden_layers))
    # per ratio-4 layer: 4 positions x (kv, score) x 2 * dim fp32, compressor (512) + indexer (128)
    assert resume_state_bytes(flash, 256) == n_c4 * 4 * 2 * 2 * (512 + 128) * 4
    with pytest.raises(ValueError, match="positive length"):
        take_resume_state(runner.kv_pool, 0, 0)


@pytest.mark.gpu
def test_on_cuda_a_state_lives_in_pinned_host_memory_and_restores_the_rows():
    from sglang.srt.mem_cache.dsv4_kv_pool import DSV4KVPool

    config = get_preset("dsv4-tiny")
    kv = DSV4KVPool(config, 4 * P, 2, torch.bfloat16, "cuda")
    _scribble_rings(kv, 0, seed=1)
    _scribble_rings(kv, 1, seed=2)
    state = take_resume_state(kv, 0, 2 * P)
    assert state.rings and all(t.device.type == "cpu" and t.is_pinned()
                               for _, a, b in state.rings.values() for t in (a, b))
    restore_resume_state(kv, 1, state)
    torch.cuda.synchronize()
    for st in list(kv.compressor_state.values()) + list(kv.indexer_state.values()):
        rows = [q % st.ring for q in ring_positions_to_keep(2 * P, st.ratio)]
        assert torch.equal(st.kv[1, rows], st.kv[0, rows]) and torch.equal(st.score[1, rows], st.score[0, rows])
