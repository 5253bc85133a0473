"""Raw (sliding-window) KV as per-request rings plus one step's staging rows (DSV4KVPool):
the metadata builder's window lists read every query's window exactly, from staging or the
ring; the rings hold each request's last W positions after every step; a reused request
slot gives the logits of a fresh runner; a step larger than the staging rows is refused."""

from __future__ import annotations

import pytest
import torch
from dsv4_kernels import ops

from sglang.srt.configs.presets import get_preset
from sglang.srt.layers.attention.dsv4.metadata_builder import build_dsv4_metadata
from sglang.srt.mem_cache.dsv4_kv_pool import DSV4KVPool
from sglang.srt.mem_cache.req_to_token_pool import ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardMode, build_forward_batch
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.test.runner_args import cpu_server_args

TAG = 10_000  # a raw row's first value tags it: request slot * TAG + position + 1 (0: never written)


def _step(pool, rtp, batch, use_kernels=False):
    """One step of (request slot, prefix, new tokens) rows: the window lists, then the model's
    raw writes (a tag per row into raw_out_loc) and the attention's ring move, on layer 0."""
    for slot, prefix, n in batch:
        rtp.ensure_capacity(slot, prefix + n)
    fb = build_forward_batch(ForwardMode.MIXED, [b[0] for b in batch], [b[1] for b in batch],
                             [[1] * b[2] for b in batch], "cpu")
    meta = build_dsv4_metadata(fb, rtp.req_to_token, padding_slot=rtp.padding_slot, page_size=rtp.page_size,
                               window=pool.window, index_topk=4, ratios={4, 128}, raw_staging_start=pool.staging_start,
                               raw_staging_rows=pool.staging_rows, use_kernels=use_kernels)
    raw = pool.raw[0]
    tags = fb.token_req_slot * TAG + fb.positions + 1
    loc = meta.raw_out_loc.long()
    assert (loc >= pool.staging_start).all()
    raw[loc, 0] = tags.float()  # what the cache write does inside the segment
    read = torch.where(meta.attn.window_slots >= 0, raw[meta.attn.window_slots.long().clamp(min=0), 0], -1.0)
    ops.keep_window_rows_(raw, pool.staging_start, meta.attn.raw_keep_loc)
    return fb, meta, read


def _check_windows(fb, meta, read, W):
    for t in range(fb.num_tokens):
        slot, pos = int(fb.token_req_slot[t]), int(fb.positions[t])
        want = [slot * TAG + q + 1 for q in range(max(0, pos - W + 1), pos + 1)]
        assert int(meta.attn.window_len[t]) == len(want)
        assert read[t, :len(want)].long().tolist() == want, (t, slot, pos)
        assert (meta.attn.window_slots[t, len(want):] == -1).all()


def _check_rings(pool, lengths):
    W, raw = pool.window, pool.raw[0]
    for slot, length in lengths.items():
        for q in range(max(0, length - W), length):
            assert int(raw[slot * W + q % W, 0]) == slot * TAG + q + 1, (slot, q)


@pytest.mark.parametrize("use_kernels", [False, True], ids=["torch", "triton"])
def test_every_window_reads_its_positions_from_staging_or_ring(monkeypatch, use_kernels):
    """Steps mixing decode rows, a fresh prefill longer than W, a chunk continuing a request, a
    short continuation (< W new tokens) and a request slot reused after a longer owner."""
    if use_kernels:
        pytest.importorskip("triton")
        if torch.cuda.is_available():
            pytest.skip("runs the Triton builder interpreted on CPU")
        monkeypatch.setattr(ops, "_use_triton", lambda t: True)
    config = get_preset("dsv4-tiny")
    W = config.sliding_window
    assert W == 8
    rtp = ReqToTokenPool(6, 512, 16, 128, "cpu")
    pool = DSV4KVPool(config, 16 * 128, 6, torch.float32, "cpu", max_step_tokens=64)
    a, b, c = rtp.alloc_req(), rtp.alloc_req(), rtp.alloc_req()
    lengths = {}
    script = [
        [(a, 0, 30), (b, 0, 5)],  # prefills: one longer than W, one shorter
        [(a, 30, 11), (b, 5, 1), (c, 0, 8)],  # a chunk continues, a decode row, a prefill of exactly W
        [(b, 6, 1), (c, 8, 3), (a, 41, 1)],  # decode rows around a continuation shorter than W
        [(c, 11, 20), (a, 42, 1), (b, 7, 1)],  # a continuation longer than W with decode rows
    ]
    for batch in script:
        fb, meta, read = _step(pool, rtp, batch, use_kernels)
        _check_windows(fb, meta, read, W)
        staged = (meta.attn.window_slots >= pool.staging_start).sum()
        read_rows = (meta.attn.window_slots >= 0).sum()
        # the first step only has fresh prefills (staging); every later one reads the rings too
        assert 0 < staged == read_rows if batch is script[0] else 0 < staged < read_rows
        for slot, prefix, n in batch:
            lengths[slot] = prefix + n
        _check_rings(pool, lengths)
    # Slot reuse: a's slot goes to a new request, which must never see a's old ring rows.
    rtp.free_req(a)
    d = rtp.alloc_req()
    assert d == a
    for batch in ([(d, 0, 3), (c, 31, 1)], [(d, 3, 2)], [(d, 5, 1)], [(d, 6, 12)]):
        fb, meta, read = _step(pool, rtp, batch, use_kernels)
        _check_windows(fb, meta, read, W)
        for slot, prefix, n in batch:
            lengths[slot] = prefix + n
        _check_rings(pool, {d: lengths[d], c: lengths[c]})


def test_padding_rows_read_nothing_and_move_nothing():
    config = get_preset("dsv4-tiny")
    rtp = ReqToTokenPool(4, 256, 8, 128, "cpu")
    pool = DSV4KVPool(config, 8 * 128, 4, torch.float32, "cpu", max_step_tokens=32)
    slot = rtp.alloc_req()
    rtp.ensure_capacity(slot, 12)
    fb = build_forward_batch(ForwardMode.EXTEND, [slot], [0], [[1] * 12], "cpu")
    meta = build_dsv4_metadata(fb, rtp.req_to_token, padding_slot=rtp.padding_slot, page_size=128, window=8,
                               index_topk=4, ratios={4, 128}, raw_staging_start=pool.staging_start,
                               raw_staging_rows=pool.staging_rows, fixed_max_seq_len=256, max_num_reqs=4)
    assert meta.num_tokens == 12
    # a bucket-sized static batch pads with rows of the padding request (graph_batch.py)
    from sglang.srt.model_executor.graph_batch import StaticBatchBuffers

    buffers = StaticBatchBuffers(16, config.hidden_size, rtp.padding_slot, torch.float32, torch.device("cpu"))
    buffers.fill(fb, 16)
    static = buffers.forward_batch(fb, 16)
    meta = build_dsv4_metadata(static, rtp.req_to_token, padding_slot=rtp.padding_slot, page_size=128, window=8,
                               index_topk=4, ratios={4, 128}, raw_staging_start=pool.staging_start,
                               raw_staging_rows=pool.staging_rows, fixed_max_seq_len=256, max_num_reqs=4)
    pad = slice(12, 16)
    assert (meta.raw_out_loc[pad] == -1).all() and (meta.attn.window_len[pad] == 0).all()
    assert (meta.attn.window_slots[pad] == -1).all()
    assert meta.attn.raw_keep_loc[pad].tolist() == [pool.staging_start + t for t in range(12, 16)]


def test_a_step_larger_than_the_staging_rows_is_refused():
    config = get_preset("dsv4-tiny")
    rtp = ReqToTokenPool(2, 256, 4, 128, "cpu")
    pool = DSV4KVPool(config, 4 * 128, 2, torch.float32, "cpu", max_step_tokens=16)
    slot = rtp.alloc_req()
    rtp.ensure_capacity(slot, 17)
    fb = build_forward_batch(ForwardMode.EXTEND, [slot], [0], [[1] * 17], "cpu")
    with pytest.raises(ValueError, match="17 tokens exceeds the 16 raw-KV staging rows"):
        build_dsv4_metadata(fb, rtp.req_to_token, padding_slot=rtp.padding_slot, page_size=128, window=8,
                            index_topk=4, ratios={4, 128}, raw_staging_start=pool.staging_start,
                            raw_staging_rows=pool.staging_rows)


# ---- request slot reuse through the model ----------------------------------------------------

def _generate(runner, slot, prompt_chunks, decode_tokens):
    """Prefill the chunks, then decode the tokens one by one; logits of every step."""
    rtp = runner.req_to_token_pool
    length, logits = 0, []
    for chunk in prompt_chunks + [[t] for t in decode_tokens]:
        rtp.ensure_capacity(slot, length + len(chunk))
        mode = ForwardMode.DECODE if len(chunk) == 1 and length > 0 else ForwardMode.EXTEND
        fb = build_forward_batch(mode, [slot], [length], [chunk], "cpu")
        logits.append(runner.forward(fb).next_token_logits[0].clone())
        length += len(chunk)
    return torch.stack(logits)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_a_short_request_in_a_reused_slot_gives_a_fresh_runners_logits(kv_cache_dtype, tmp_path):
    """A long request (many windows) fills its slot's rings; the next request in that slot is
    shorter than one window and must give exactly what a fresh runner gives: it reads none of
    the old rows. Decode steps replay decode graphs (the ring move captured)."""
    over = {}
    if kv_cache_dtype == "fp8_e4m3":  # whole 64-dim nope blocks: dsv4-tiny with head_dim 80
        import json

        cfg = get_preset("dsv4-tiny").to_dict()
        cfg["head_dim"] = 80
        path = tmp_path / "dsv4-tiny-head80.json"
        path.write_text(json.dumps(cfg))
        over = dict(model_path=str(path), kv_cache_dtype=kv_cache_dtype)
    args = dict(dict(model_path="dsv4-tiny", context_length=512, max_total_tokens=2048, max_running_requests=2,
                     cuda_graph_max_bs=2), **over)
    used, fresh = (ModelRunner(cpu_server_args(**args), cuda_graph_on_cpu=True) for _ in range(2))
    gen = torch.Generator().manual_seed(0)
    long_prompt = torch.randint(3, 500, (45,), generator=gen).tolist()
    slot = used.req_to_token_pool.alloc_req()
    _generate(used, slot, [long_prompt[:30], long_prompt[30:]], torch.randint(3, 500, (12,), generator=gen).tolist())
    used.req_to_token_pool.free_req(slot)
    reused = used.req_to_token_pool.alloc_req()
    assert reused == slot and used.kv_pool.raw[0][slot * 8:(slot + 1) * 8].abs().sum() > 0
    short = torch.randint(3, 500, (3,), generator=gen).tolist()
    decode = torch.randint(3, 500, (4,), generator=gen).tolist()
    got = _generate(used, reused, [short[:2], short[2:]], decode)
    want = _generate(fresh, fresh.req_to_token_pool.alloc_req(), [short[:2], short[2:]], decode)
    assert used.decode_graph_runner.num_replays >= 4 + 12
    assert torch.equal(got, want)
