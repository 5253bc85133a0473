"""Long context: no step metadata grows with the context length (the c4 / c128 candidates are
read through the page table; only host-int widths follow the sequences), nothing a breakable
graph holds does either (the indexer's top-k lives in the eager break, in bounded chunks),
replay still equals eager, and chunked prefill through graphs over a prompt longer than the
candidate widths of its chunks matches one full prefill."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "models"))
from dsv4_harness import Session, prefill_in_chunks, run_step  # noqa: E402

from sglang.srt.configs.presets import get_preset  # noqa: E402
from sglang.srt.configs.presets import write_config  # noqa: E402
from sglang.srt.layers.attention.dsv4 import widths  # noqa: E402
from sglang.srt.layers.attention.dsv4.metadata_builder import build_dsv4_metadata  # noqa: E402
from sglang.srt.mem_cache.req_to_token_pool import ReqToTokenPool  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode, build_forward_batch  # noqa: E402
from sglang.srt.model_executor.graph_runner import tensor_bytes  # noqa: E402
from sglang.srt.model_executor.model_runner import ModelRunner  # noqa: E402
from sglang.test.runner_args import cpu_server_args  # noqa: E402

BUCKETS = [64]  # one bucket: capture is most of these tests' time
ONE_M = 1 << 20


@pytest.fixture(scope="module")
def long_tiny(tmp_path_factory):
    """dsv4-tiny that accepts a 1M-token context (its own maximum is 4096)."""
    d = tmp_path_factory.mktemp("tiny_1m")
    write_config(dataclasses.replace(get_preset("dsv4-tiny"), max_position_embeddings=ONE_M), str(d))
    return str(d)


def _breakable_runner(model_path, context_length, **kw):
    return ModelRunner(cpu_server_args(
        model_path=model_path, load_format="dummy", context_length=context_length, max_total_tokens=4096,
        max_running_requests=4, enable_breakable_cuda_graph=True, breakable_cuda_graph_tokens=BUCKETS, **kw))


def _tokens(n, seed):
    return torch.randint(2, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_graph_buffers_are_the_same_at_8k_and_1m_context(long_tiny):
    short, long = _breakable_runner(long_tiny, 8192), _breakable_runner(long_tiny, ONE_M)
    eager = ModelRunner(cpu_server_args(model_path=long_tiny, load_format="dummy", context_length=ONE_M,
                                        max_total_tokens=4096, max_running_requests=4))
    for bucket in BUCKETS:
        captured = [r.breakable_runner.captured_metadata[bucket] for r in (short, long)]
        assert captured[1].max_seq_len == ONE_M  # the long runner did capture for a 1M context
        assert tensor_bytes(captured[0]) == tensor_bytes(captured[1])
        # Before: the c4 candidate list alone was bucket x 1M/4 int32 (64 MiB at bucket 64).
        assert tensor_bytes(captured[1]) < 64 * 1024 * bucket
    # what the runner reports (static batch buffers + every bucket's captured metadata)
    assert short.breakable_runner.static_buffer_bytes() == long.breakable_runner.static_buffer_bytes()
    # The same live batch replays identically on both, and as eager computes it.
    prompt = _tokens(300, seed=5)
    outs = []
    for runner in (short, long, eager):
        s = Session(runner)
        outs.append(run_step(runner, [s], [prompt[:40]]).next_token_logits[0])
        outs.append(run_step(runner, [s], [prompt[40:100]]).next_token_logits[0])
        live = runner.attn_backend.forward_metadata
        assert live.indexer.cand_width == 100 // 4  # the batch's width, not the context's
        s.release()
    assert short.breakable_runner.num_replays == long.breakable_runner.num_replays == 2
    for a, b, want in zip(outs[0:2], outs[2:4], outs[4:6]):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, want, rtol=1e-4, atol=1e-4)
    for r in (short, long, eager):
        r.shutdown()


def _tensor_shapes(meta, prefix=""):
    out = {}
    for f in dataclasses.fields(meta):
        v = getattr(meta, f.name)
        if isinstance(v, torch.Tensor):
            out[prefix + f.name] = (tuple(v.shape), v.dtype)
        elif dataclasses.is_dataclass(v):
            out.update(_tensor_shapes(v, f"{prefix}{f.name}."))
    return out


def _step_metadata_at(context, **kw):
    """The metadata of one mixed step (a 64-token prefill chunk and a decode row) whose
    requests end at the context length, on a dsv4-flash-like layout (window 128, top-512)."""
    rtp = ReqToTokenPool(max_num_reqs=2, max_context_len=context, num_pages=2 * context // 128 + 1, page_size=128,
                         device="cpu")
    slots = [rtp.alloc_req(), rtp.alloc_req()]
    for s in slots:
        rtp.ensure_capacity(s, context)
    fb = build_forward_batch(ForwardMode.MIXED, slots, [context - 64, context - 1], [[5] * 64, [7]], "cpu")
    return build_dsv4_metadata(fb, rtp.req_to_token, padding_slot=rtp.padding_slot, page_size=128, window=128,
                               index_topk=512, ratios={4, 128}, max_num_reqs=2, raw_staging_start=2 * 128,
                               raw_staging_rows=65, **kw)


@pytest.mark.parametrize("graph", ["eager", "breakable", "full"])
def test_step_metadata_is_the_same_size_at_8k_and_1m_context(graph):
    """The same batch at an 8K and a 1M context: every metadata tensor has the same shape.
    Before, the c4 candidate slots alone were [T, context / 4] (at 1M: 65 x 262144 int32,
    68 MB here; 4.3 GB for a 4096-token chunk)."""
    kw = {} if graph == "eager" else dict(fixed_max_seq_len=None, full_graph=graph == "full")
    metas = []
    for context in (8192, ONE_M):
        if graph != "eager":
            kw["fixed_max_seq_len"] = context
        metas.append(_step_metadata_at(context, **kw))
    short, long = metas
    assert _tensor_shapes(short) == _tensor_shapes(long)
    # per token: the window (128) and top-k (512) slots, the compressor's source rows, scalars
    assert tensor_bytes(short) == tensor_bytes(long) < 65 * 4 * 1024
    # ...while the candidates they describe do reach 1M: widths are host ints, the lengths and
    # page-table rows per token
    assert (long.indexer.cand_width, long.attn.c128_width) == (ONE_M // 4, ONE_M // 128)
    assert long.indexer.cand_len[:65].tolist() == [p // 4 for p in range(ONE_M - 63, ONE_M + 1)] + [ONE_M // 4]
    assert long.token_rows[:65].tolist() == [0] * 64 + [1]


def test_chunked_prefill_through_graphs_matches_full_prefill(monkeypatch):
    # A workspace of 16 tokens x 175 candidates: the bounded top-k loop runs several chunks
    # per layer (4 per graph step, up to 44 in the full prefill).
    monkeypatch.setattr(widths, "INDEXER_WORKSPACE_BYTES", 16 * (700 // 4) * widths.indexer_bytes_per_candidate(
        get_preset("dsv4-tiny"), kernels=False))
    assert widths.indexer_chunk_tokens(get_preset("dsv4-tiny"), 700 // 4, kernels=False) == 16
    cfg = dict(model_path="dsv4-tiny", context_length=1024, max_total_tokens=4096, max_running_requests=4)
    breakable = ModelRunner(cpu_server_args(**cfg, enable_breakable_cuda_graph=True, breakable_cuda_graph_tokens=BUCKETS))
    eager = ModelRunner(cpu_server_args(**cfg))
    prompt = _tokens(700, seed=11)
    # Chunks of 60 replay in bucket 64; every chunk's candidate lists (up to 175 c4 entries)
    # are wider than the chunk itself.
    chunked = prefill_in_chunks(breakable, prompt, [60])
    assert breakable.breakable_runner.num_replays == len(chunked) == 12
    full = prefill_in_chunks(eager, prompt, [700])
    torch.testing.assert_close(chunked[-1], full[-1], rtol=1e-4, atol=1e-4)
    assert chunked[-1].argmax() == full[-1].argmax()
    breakable.shutdown()
    eager.shutdown()
