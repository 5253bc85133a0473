"""FP8 KV cache (--kv-cache-dtype fp8_e4m3) and the release numerics' KV rounding: pool
layout, bytes per token, and that an FP8 cache gives the model exactly the values that
release rounding with a float cache gives it."""

import pytest
import torch
from dsv4_kernels.kv_fp8 import FP8KVLayout, round_nope_fp8

from sglang.srt.configs.presets import get_preset
from sglang.srt.mem_cache.dsv4_kv_pool import DSV4KVPool, kv_bytes_per_token, raw_ring_bytes_per_request
from sglang.srt.model_executor.forward_batch_info import ForwardMode, build_forward_batch
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.planning.memory_planner import kv_bytes_per_token as planner_kv_bytes_per_token
from sglang.test.runner_args import cpu_server_args


def test_fp8_pool_holds_uint8_rows_for_every_kv_entry_and_float_indexer_keys():
    cfg = get_preset("dsv4-tiny-fp8")  # head_dim 128 = 64 nope + 64 rope; ratios 0, 4, 128, 4
    pool = DSV4KVPool(cfg, 1024, 4, torch.bfloat16, "cpu", kv_cache_dtype="fp8_e4m3", max_step_tokens=32)
    assert pool.fp8_layout == FP8KVLayout(128, 64, torch.bfloat16) and pool.nope_fp8
    row = 64 + 128 + 1 + 7  # e4m3 nope, bf16 rope, one scale, pad to 8
    # raw KV: a ring of window (8) rows per request slot, then 32 staging rows
    assert [tuple(t.shape) for t in pool.raw] == [(4 * 8 + 32, row)] * 4 and pool.staging_start == 32
    assert {k: tuple(v.shape) for k, v in pool.compressed.items()} == {1: (256, row), 2: (8, row), 3: (256, row)}
    assert all(t.dtype == torch.uint8 for t in [*pool.raw, *pool.compressed.values()])
    assert all(t.dtype == torch.bfloat16 for t in pool.indexer_keys.values())
    assert pool.decode_kv(pool.raw[0]).abs().max() == 0  # fresh rows read back as zeros
    plain = DSV4KVPool(cfg, 1024, 4, torch.bfloat16, "cpu", max_step_tokens=32)
    kv_bytes = lambda p: sum(t.numel() * t.element_size() for t in [*p.raw, *p.compressed.values()])  # noqa: E731
    assert kv_bytes(plain) / kv_bytes(pool) == 256 / row
    assert plain.fp8_layout is None and not plain.nope_fp8


def test_encode_kv_follows_the_pool_format():
    cfg = get_preset("dsv4-tiny-fp8")
    rows = torch.randn(5, 128)
    fp8 = DSV4KVPool(cfg, 256, 2, torch.float32, "cpu", kv_cache_dtype="fp8_e4m3", max_step_tokens=8)
    rounded = DSV4KVPool(cfg, 256, 2, torch.float32, "cpu", round_nope_fp8=True, max_step_tokens=8)
    plain = DSV4KVPool(cfg, 256, 2, torch.float32, "cpu", max_step_tokens=8)
    want = round_nope_fp8(rows, 64)
    assert torch.equal(fp8.decode_kv(fp8.encode_kv(rows, fp8.raw[0])), want)  # fp32 model: fp32 rope
    assert torch.equal(rounded.encode_kv(rows, rounded.raw[0]), want)
    assert torch.equal(plain.encode_kv(rows, plain.raw[0]), rows)
    assert not torch.equal(want, rows)


def test_a_head_split_without_whole_64_dim_nope_blocks_is_refused():
    tiny = get_preset("dsv4-tiny")  # head_dim 64, rope 16: 48 nope dims
    for kw in (dict(kv_cache_dtype="fp8_e4m3"), dict(round_nope_fp8=True)):
        with pytest.raises(ValueError, match="48 nope dims must be a positive multiple of 64"):
            DSV4KVPool(tiny, 256, 2, torch.float32, "cpu", max_step_tokens=8, **kw)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        DSV4KVPool(tiny, 256, 2, torch.float32, "cpu", kv_cache_dtype="fp8", max_step_tokens=8)
    with pytest.raises(ValueError, match="max_step_tokens must be positive"):
        DSV4KVPool(tiny, 256, 2, torch.float32, "cpu", max_step_tokens=0)


def test_bytes_per_token_in_both_modes():
    mini = get_preset("dsv4-mini")  # ratios 0,0,4,128,4,128,4,0; head 512 (448 + 64), index 128
    # bf16: 3/4 of a c4 row of 1024 B + 2/128 of a c128 row + 3/4 of a 256 B key; raw KV is
    # per request (a window ring), not per token
    assert kv_bytes_per_token(mini, torch.bfloat16) == 3 * 1024 / 4 + 2 * 1024 / 128 + 3 * 256 / 4
    # fp8: the same with 584 B rows (448 e4m3 + 128 rope + 7 scales + 1 pad); keys stay bf16
    assert kv_bytes_per_token(mini, torch.bfloat16, "fp8_e4m3") == 3 * 584 / 4 + 2 * 584 / 128 + 3 * 256 / 4
    # what server_args sizes the cache with (the memory planner): the pool's count, whole bytes
    # (rounded up: 976 exactly, 639.125)
    assert (planner_kv_bytes_per_token(mini, "auto"), planner_kv_bytes_per_token(mini, "fp8_e4m3")) == (976, 640)
    # a request slot's rings: 128 rows on each of the 8 layers
    assert raw_ring_bytes_per_request(mini, torch.bfloat16, "fp8_e4m3") == 8 * 128 * 584
    flash = get_preset("dsv4-flash-slice")
    ratio = kv_bytes_per_token(flash, torch.bfloat16, "fp8_e4m3") / kv_bytes_per_token(flash, torch.bfloat16)
    assert 0.65 < ratio < 0.66  # rows shrink to 584/1024; the bf16 indexer keys do not


def _prefill_in_two_chunks(**over):
    """dsv4-tiny-fp8 (release-format weights, fp32 on CPU): 150 prompt tokens in chunks of
    100 and 50 (every cache: window, c4, one c128 entry), logits of both chunks."""
    runner = ModelRunner(cpu_server_args(model_path="dsv4-tiny-fp8", context_length=512, max_total_tokens=1024,
                                         max_running_requests=2, **over))
    rtp = runner.req_to_token_pool
    slot = rtp.alloc_req()
    ids = torch.randint(3, 500, (150,), generator=torch.Generator().manual_seed(0)).tolist()
    logits = []
    for start, end in ((0, 100), (100, 150)):
        rtp.ensure_capacity(slot, end)
        fb = build_forward_batch(ForwardMode.EXTEND, [slot], [start], [ids[start:end]], "cpu")
        logits.append(runner.forward(fb).next_token_logits)
    return runner, torch.cat(logits)


def test_fp8_cache_gives_the_model_what_release_rounding_with_a_float_cache_gives():
    fp8, fp8_logits = _prefill_in_two_chunks(kv_cache_dtype="fp8_e4m3")
    flt, flt_logits = _prefill_in_two_chunks(kv_cache_dtype="auto")
    assert fp8.server_args.quant_numerics == flt.server_args.quant_numerics == "release"
    assert flt.kv_pool.raw[0].dtype == torch.float32 and fp8.kv_pool.raw[0].dtype == torch.uint8
    for layer in range(4):  # the very same cached values, window and compressed entries
        assert torch.equal(fp8.kv_pool.decode_kv(fp8.kv_pool.raw[layer]), flt.kv_pool.raw[layer])
    for layer in (1, 2, 3):
        assert torch.equal(fp8.kv_pool.decode_kv(fp8.kv_pool.compressed[layer]), flt.kv_pool.compressed[layer])
    W = flt.config.sliding_window
    cached = flt.kv_pool.raw[0][:W]  # request slot 0's ring: positions 142..149
    assert torch.equal(round_nope_fp8(cached, 64), cached) and cached[:, :64].abs().min() < cached[:, :64].abs().max()
    torch.testing.assert_close(fp8_logits, flt_logits, rtol=0, atol=1e-5)


def test_weight_only_numerics_keep_a_float_cache_unrounded_and_fp8_storage_still_rounds():
    cfg = dict(model_path="dsv4-tiny-fp8", context_length=512, max_total_tokens=1024, max_running_requests=2,
               quant_numerics="weight_only")
    assert not ModelRunner(cpu_server_args(**cfg)).kv_pool.nope_fp8  # resolves to a float cache
    fp8 = ModelRunner(cpu_server_args(**cfg, kv_cache_dtype="fp8_e4m3")).kv_pool
    assert fp8.nope_fp8 and fp8.fp8_layout is not None  # storage in e4m3 rounds whatever the numerics


# ---- on an H200: dsv4-mini in bf16 (head_dim 512: 584-byte rows), compiled kernels ----------

GPU_MINI = dict(model_path="dsv4-mini", device="cuda", dtype="bfloat16", context_length=2048,
                max_total_tokens=96 * 1024, max_running_requests=12, kv_cache_dtype="fp8_e4m3")


def _harness(subdir: str):
    import os
    import sys

    here = os.path.dirname(__file__)
    sys.path.insert(0, os.path.join(here, "..", *subdir.split("/")))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_fp8_cache_replays_and_matches_the_torch_reference_path():
    """Real breakable CUDA graphs over an FP8 cache replay exactly what eager computes on the
    padded batch; the Triton path (FP8 write and read kernels) agrees with the torch reference
    path on the same FP8 cache; and the FP8 cache stays close to a bf16 cache."""
    _harness("attention/unittests/dsv4")
    _harness("models")
    from breakable_equivalence import make_runners, run_equivalence
    from dsv4_harness import prefill_in_chunks

    buckets = (64, 256)
    runners = make_runners(buckets, **GPU_MINI)
    assert runners[0].kv_pool.fp8_layout.row_bytes == 584
    report = run_equivalence(runners, buckets, batches_per_bucket=12, seed=7, max_len=1800,
                             atol_unpadded=float("inf"))
    print(f"\nfp8 kv: batches={report.batches} max|replay - unpadded eager|={report.max_unpadded_diff:.4f}")
    assert [m for m in report.mismatches if m.what.startswith("replay vs eager on the padded")] == []
    for r in runners:
        r.shutdown()

    tok = torch.randint(3, 30000, (700,), generator=torch.Generator().manual_seed(0)).tolist()
    out = {}
    for name, over in (("torch_fp8", dict(attention_backend="torch")), ("triton_fp8", {}),
                       ("triton_bf16", dict(kv_cache_dtype="auto"))):
        r = ModelRunner(cpu_server_args(**dict(GPU_MINI, disable_cuda_graph=True, **over)))
        out[name] = torch.stack(prefill_in_chunks(r, tok, [300, 1]))[-8:].float()
        r.shutdown()
    for a, b, floor in (("torch_fp8", "triton_fp8", 0.99), ("triton_bf16", "triton_fp8", 0.9)):
        cos = torch.nn.functional.cosine_similarity(out[a], out[b], dim=-1)
        agree = (out[a].argmax(-1) == out[b].argmax(-1)).float().mean().item()
        print(f"{a} vs {b}: min cos={cos.min().item():.5f} argmax agreement={agree:.2f}")
        assert cos.min().item() > floor
