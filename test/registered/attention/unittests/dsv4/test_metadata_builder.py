"""The step metadata builder: dsv4_kernels' Triton builders (interpreted on CPU) give exactly
the torch reference's metadata on real batches, eager and static widths; building `into` a
captured metadata fills its copy fields in place and leaves its assign fields alone."""

import pytest
import torch
from dsv4_kernels import ops

from sglang.bench_one_batch_steps import make_batch
from sglang.srt.layers.attention.dsv4.metadata import DSV4Metadata
from sglang.srt.layers.attention.dsv4.field_classes import COPY, field_classes
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.test.runner_args import cpu_server_args


@pytest.fixture(scope="module")
def runner():
    r = ModelRunner(cpu_server_args(context_length=512, max_running_requests=8, max_total_tokens=8 * 640))
    yield r
    r.shutdown()


def _tensors(meta, prefix=""):
    out = {}
    for name in field_classes(meta):
        v = getattr(meta, name)
        if isinstance(v, torch.Tensor):
            out[prefix + name] = v
        elif v is not None and hasattr(v, "__dataclass_fields__"):
            out.update(_tensors(v, f"{prefix}{name}."))
    return out


def _build(runner, fb, static, **kw):
    return runner.attn_backend._build(fb, static=static, **kw)


@pytest.mark.parametrize("mode,n,prefix", [("extend", 40, 130), ("mixed", 23, 257), ("extend", 7, 0)])
@pytest.mark.parametrize("static", [False, True])
def test_triton_builders_equal_the_torch_reference(runner, monkeypatch, mode, n, prefix, static):
    pytest.importorskip("triton")
    if torch.cuda.is_available():  # the CPU runner's tensors reach Triton only via the interpreter
        pytest.skip("runs the Triton builders interpreted on CPU; GPUs check them in sgl-kernel/tests")
    fb, slots = make_batch(runner, mode, n, prefix, 32, min(5, n // 2))
    try:
        backend = runner.attn_backend
        assert backend.kernels == "torch"  # CPU: the reference
        expected = _tensors(_build(runner, fb, static))
        monkeypatch.setattr(backend, "kernels", "triton")
        monkeypatch.setattr(ops, "_use_triton", lambda t: True)  # the interpreter on CPU
        got = _tensors(_build(runner, fb, static))
    finally:
        for s in slots:
            runner.req_to_token_pool.free_req(s)
    assert got.keys() == expected.keys()
    assert "c4_compressor.gather_idx" in got and "token_rows" in got and "indexer.cand_len" in got
    for k in expected:
        assert got[k].dtype == expected[k].dtype and torch.equal(got[k], expected[k]), k
    assert (got["raw_out_loc"] >= 0).sum() == n


def test_building_into_a_captured_metadata_fills_copy_fields_in_place(runner):
    fb1, s1 = make_batch(runner, "mixed", 30, 200, 32, 6)
    fb2, s2 = make_batch(runner, "extend", 30, 64, 32, 0)
    try:
        captured = _build(runner, fb1, True)
        before = _tensors(captured)
        fresh = _build(runner, fb2, True, into=captured)
        reference = _tensors(_build(runner, fb2, True))
    finally:
        for s in s1 + s2:
            runner.req_to_token_pool.free_req(s)
    got = _tensors(fresh)
    copy_fields = {"raw_out_loc", "positions", "indexer.cand_len", "indexer.topk_len",
                   "c4_compressor.gather_idx", "c128_compressor.ring_write_loc"}
    for k in copy_fields:
        assert got[k] is before[k], f"{k} must keep the captured storage"
    # Read by the eager break only: new storage (and the live batch's widths).
    for k in ("attn.window_slots", "attn.raw_keep_loc", "attn.c128_len", "token_rows"):
        assert got[k] is not before[k], f"{k} is an assign field: new storage"
    assert (fresh.indexer.cand_width, fresh.attn.c128_width) == ((64 + 30) // 4, 1)  # widths are at least 1
    for k in reference:
        if k != "indexer.topk_slots":  # produced: the captured storage, never rebuilt
            assert torch.equal(got[k], reference[k]), k
    assert field_classes(DSV4Metadata)["raw_out_loc"] == COPY
