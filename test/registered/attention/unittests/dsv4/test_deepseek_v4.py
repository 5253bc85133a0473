"""DSV4 breakable CUDA graphs: the metadata contract (docs/design.md, contract 4) and replay == eager on the
CPU emulator, including tests that show the harness catches the two classic bugs."""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from breakable_equivalence import make_runners, run_equivalence, run_long_prefills, run_scripted  # noqa: E402

from sglang.srt.configs.presets import get_preset  # noqa: E402
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend  # noqa: E402
from sglang.srt.layers.attention.deepseek_v4_backend import DeepseekV4AttnBackend  # noqa: E402
from sglang.srt.layers.attention.dsv4 import field_classes as fc  # noqa: E402
from sglang.srt.layers.attention.dsv4.metadata import (  # noqa: E402
    DSV4AttnMetadata,
    DSV4CompressorMetadata,
    DSV4IndexerMetadata,
    DSV4Metadata,
)
from sglang.srt.model_executor.forward_batch_info import ForwardMode, build_forward_batch  # noqa: E402
from sglang.srt.model_executor.graph_dispatch import PathKind, decide_step_path, describe  # noqa: E402
from sglang.srt.model_executor.model_runner import ModelRunner  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402
from sglang.test.runner_args import cpu_server_args  # noqa: E402

METADATA_TYPES = (DSV4Metadata, DSV4AttnMetadata, DSV4IndexerMetadata, DSV4CompressorMetadata)
BUCKETS = (16, 48, 128)


@pytest.fixture
def tiny_runner():
    return ModelRunner(cpu_server_args(model_path="dsv4-tiny", context_length=1024, max_total_tokens=8192,
                                       max_running_requests=8))


def _batch(runner, chunks, prefixes=None):
    rtp = runner.req_to_token_pool
    slots = [rtp.alloc_req() for _ in chunks]
    prefixes = prefixes or [0] * len(chunks)
    for s, p, c in zip(slots, prefixes, chunks):
        rtp.ensure_capacity(s, p + len(c))
    return build_forward_batch(ForwardMode.EXTEND, slots, prefixes, chunks, "cpu")


class TestDSV4BreakableCudaGraphMetadataContract:
    def test_breakable_is_off_by_default(self):
        assert ServerArgs().enable_breakable_cuda_graph is False

    def test_only_the_dsv4_backend_opts_in(self):
        assert AttentionBackend.use_captured_forward_metadata_for_breakable_cuda_graph is False
        opted_in = [c for c in _all_subclasses(AttentionBackend)
                    if c.use_captured_forward_metadata_for_breakable_cuda_graph]
        assert opted_in == [DeepseekV4AttnBackend]

    @pytest.mark.parametrize("cls", METADATA_TYPES, ids=lambda c: c.__name__)
    def test_every_field_is_classified(self, cls):
        assert fc.unclassified_fields(cls) == []
        assert set(fc.field_classes(cls).values()) <= set(fc.FIELD_CLASSES)

    def test_an_unclassified_field_is_caught(self):
        @dataclasses.dataclass
        class WithNewField(DSV4AttnMetadata):
            new_tensor: torch.Tensor = None  # forgot to declare its class

        assert fc.unclassified_fields(WithNewField) == ["WithNewField.new_tensor"]
        a = WithNewField(*[torch.zeros(2, 3)] * 4, 1, new_tensor=torch.zeros(2))
        with pytest.raises(fc.MetadataContractError, match="new_tensor: field has no breakable-cuda-graph class"):
            a.refresh_for_breakable_cuda_graph_replay_(WithNewField(*[torch.ones(2, 3)] * 4, 1, new_tensor=torch.ones(2)))

    def test_refresh_follows_each_field_class(self, tiny_runner):
        backend = tiny_runner.attn_backend
        captured = backend.init_forward_metadata_for_breakable_cuda_graph_capture(
            _batch(tiny_runner, [list(range(3, 40)), list(range(5, 20))]))
        replay_fb = _batch(tiny_runner, [list(range(7, 30)), list(range(9, 38))], prefixes=[0, 0])
        fresh = backend._build(replay_fb, static=True)
        before = {name: getattr(captured, name) for name in ("raw_out_loc", "positions")}
        c4_before = captured.c4_compressor.gather_idx
        topk_before = captured.indexer.topk_slots
        captured.indexer.topk_slots.fill_(123)  # as if the indexer had written it in-segment
        attn_obj = captured.attn

        captured.refresh_for_breakable_cuda_graph_replay_(fresh)

        for name, t in before.items():  # copy: same tensor object, replay values
            assert getattr(captured, name) is t
            assert torch.equal(t, getattr(fresh, name))
        assert captured.c4_compressor.gather_idx is c4_before
        assert torch.equal(c4_before, fresh.c4_compressor.gather_idx)
        assert captured.attn is attn_obj  # nested metadata keeps its identity...
        assert captured.attn.window_slots is fresh.attn.window_slots  # ...its assign fields are the replay's
        assert captured.attn.c128_len is fresh.attn.c128_len
        assert captured.attn.raw_keep_loc is fresh.attn.raw_keep_loc  # the break's ring move, the replay's
        assert captured.token_rows is fresh.token_rows
        assert captured.indexer.cand_width == fresh.indexer.cand_width == 29 // 4  # the replay's longest sequence
        assert captured.indexer.topk_slots is topk_before  # produced: untouched
        assert bool((topk_before == 123).all())

    def test_decode_refresh_copies_every_tensor_in_place(self, tiny_runner):
        """A full decode graph reads the break's inputs inside the graph too: its refresh
        replaces nothing, copies assign tensors like copy ones, and holds host widths equal."""
        backend = tiny_runner.attn_backend
        captured = backend._build(_batch(tiny_runner, [list(range(3, 40)), list(range(5, 20))]), static=True,
                                  full_graph=True)
        fresh = backend._build(_batch(tiny_runner, [list(range(7, 30)), list(range(9, 38))], prefixes=[0, 0]),
                               static=True, full_graph=True)
        held = {name: getattr(captured.attn, name) for name in ("window_slots", "window_len", "raw_keep_loc",
                                                                "c128_len")}
        token_rows = captured.token_rows
        assert not torch.equal(held["window_len"], fresh.attn.window_len)

        captured.refresh_for_decode_cuda_graph_replay_(fresh)

        for name, t in held.items():
            assert getattr(captured.attn, name) is t and torch.equal(t, getattr(fresh.attn, name))
        assert captured.token_rows is token_rows and torch.equal(token_rows, fresh.token_rows)
        wider = dataclasses.replace(fresh, indexer=dataclasses.replace(fresh.indexer,
                                                                       cand_width=fresh.indexer.cand_width + 1))
        with pytest.raises(fc.MetadataContractError,
                           match=r"DSV4IndexerMetadata\.cand_width: host value read inside the full graph differs"):
            captured.refresh_for_decode_cuda_graph_replay_(wider)

    def test_static_mismatch_raises(self, tiny_runner):
        backend = tiny_runner.attn_backend
        captured = backend._build(_batch(tiny_runner, [list(range(3, 20))]), static=True)
        fresh = dataclasses.replace(backend._build(_batch(tiny_runner, [list(range(3, 20))]), static=True),
                                    window=captured.window + 1)
        with pytest.raises(fc.MetadataContractError, match=r"DSV4Metadata\.window: static field differs"):
            captured.refresh_for_breakable_cuda_graph_replay_(fresh)

    def test_copy_field_shape_change_raises(self, tiny_runner):
        backend = tiny_runner.attn_backend
        a = backend._build(_batch(tiny_runner, [list(range(3, 20))]), static=True)
        b = backend._build(_batch(tiny_runner, [list(range(3, 30))]), static=True)
        with pytest.raises(fc.MetadataContractError):
            a.refresh_for_breakable_cuda_graph_replay_(b)

    def test_backend_replay_builds_from_static_batch_and_keeps_captured_active(self, tiny_runner):
        backend = tiny_runner.attn_backend
        static_fb = _batch(tiny_runner, [list(range(3, 35))])
        captured = backend.init_forward_metadata_for_breakable_cuda_graph_capture(static_fb)
        live_fb = _batch(tiny_runner, [list(range(3, 11))])  # fewer tokens than the bucket
        static_replay = _batch(tiny_runner, [list(range(3, 35))])
        backend.forward_metadata = None
        backend.prepare_forward_metadata_for_breakable_cuda_graph_replay(
            captured, live_fb, static_forward_batch=static_replay)
        assert backend.forward_metadata is captured
        assert captured.num_tokens == 32  # bucket-sized (from the static batch), not live-sized
        assert torch.equal(captured.positions, static_replay.positions)


def _all_subclasses(cls):
    import sglang.srt.layers.attention.deepseek_v4_backend  # noqa: F401  (registers the backend)

    out = []
    for sub in cls.__subclasses__():
        out.append(sub)
        out.extend(_all_subclasses(sub))
    return out


# ---- replay == eager on the CPU emulator --------------------------------------------------

@pytest.fixture(scope="module")
def runners():
    return make_runners(BUCKETS)


@pytest.mark.slow
def test_replay_equals_eager_on_randomised_extend_and_mixed_batches(runners):
    report = run_equivalence(runners, BUCKETS, batches_per_bucket=200, seed=1)
    assert report.mismatches == [], report.mismatches[:5]
    assert report.batches == 200 * len(BUCKETS)
    assert report.modes.get("MIXED", 0) > 100 and report.modes.get("EXTEND", 0) > 100
    for b in BUCKETS:  # token counts at the bucket size and just under it were exercised
        assert b in report.tokens and b - 1 in report.tokens
    assert runners[0].breakable_runner.num_replays >= report.batches


def test_replay_equals_eager_past_positions_128_and_512_and_replays_the_smallest_fitting_bucket():
    """The fast equivalence run: 5 replayed steps carry a request past positions 128
    and 4 x 128 (c128 and c4 blocks emitted inside the replayed step, ring state read across
    steps) next to a decode row; every step replays the smallest bucket that holds it."""
    runners = make_runners(BUCKETS)
    graph_runner = runners[0].breakable_runner
    report = run_long_prefills(runners, chunk=120, total_len=530, num_reqs=1)
    assert report.mismatches == [], report.mismatches[:5]
    assert report.batches == 5 and report.modes == {"EXTEND": 1, "MIXED": report.batches - 1}
    # A few random batches of every bucket's range, for the bucket choice.
    mixed = run_equivalence(runners, BUCKETS, batches_per_bucket=2, seed=3)
    assert mixed.mismatches == [], mixed.mismatches[:5]
    expected = {}
    for n in report.tokens + mixed.tokens:
        bucket = str(min(b for b in BUCKETS if b >= n))
        expected[bucket] = expected.get(bucket, 0) + 1
    assert graph_runner.get_stats()["breakable_replays_by_bucket"] == expected
    assert set(expected) == {str(b) for b in BUCKETS}


def test_replay_equals_eager_with_extends_longer_than_the_window_beside_decode_rows():
    """dsv4-tiny's window is 8: extends of W - 1, W, W + 1 and several windows long, chunked
    continuations and decode rows in the same batches, so every replayed step reads windows
    from both the staging rows and the rings, and moves rows into the rings, in the break."""
    runners = make_runners(BUCKETS)
    assert runners[0].config.sliding_window == 8
    script = [
        [("a", 30), ("b", 5)],
        [("a", 9), ("c", 8), ("b", 1)],
        [("c", 7), ("d", 40), ("a", 1), ("b", 1)],
        [("a", 17), ("e", 3), ("b", 1), ("c", 1), ("d", 1)],
        [("d", 100), ("e", 1), ("a", 1), ("b", 1), ("c", 1)],
        [("b", 2), ("a", 1), ("c", 1), ("d", 1), ("e", 1)],
    ]
    report = run_scripted(runners, script)
    assert report.mismatches == [], report.mismatches[:5]
    assert report.batches == len(script) and report.modes == {"EXTEND": 1, "MIXED": len(script) - 1}
    assert runners[0].breakable_runner.num_replays == len(script)


def test_the_attention_break_op_gets_the_live_token_count_not_the_bucket(monkeypatch):
    """Replaying a 16-token bucket for 7 live tokens: the break op hands the backend n = 7 (the
    padding is neither attended nor paid for), while q keeps the bucket's 16 rows."""
    from breakable_equivalence import TINY

    runner = ModelRunner(cpu_server_args(**TINY, enable_breakable_cuda_graph=True,
                                         breakable_cuda_graph_tokens=[16]))
    seen = []
    real_forward = DeepseekV4AttnBackend.forward

    def spy(self, q, sink, output, layer_id, num_tokens, *args, **kwargs):
        seen.append((layer_id, q.shape[0], num_tokens))
        return real_forward(self, q, sink, output, layer_id, num_tokens, *args, **kwargs)

    monkeypatch.setattr(DeepseekV4AttnBackend, "forward", spy)
    fb = _batch(runner, [[5, 6, 7, 8], [9, 10, 11]])
    path = decide_step_path((describe(fb),), runner.graph_tables)
    assert (path.kind, path.size) == (PathKind.BREAKABLE, 16)
    runner.breakable_runner.replay_hidden(fb, path.size)
    num_layers = runner.model.config.num_hidden_layers
    assert seen == [(layer, 16, 7) for layer in range(num_layers)]


def test_a_replay_pays_for_live_rows_only_in_the_attention_core_and_the_indexer(monkeypatch):
    """Padding costs nothing where the work is: replaying a 16-token bucket for 7 live tokens,
    every layer's sink-attention core gets 7 query rows (and writes 7 output rows), and every
    c4 layer's indexer top-k selects for 7 tokens. The break op passing n = 7 is not enough:
    a backend that attended all 16 rows would still give the right live outputs."""
    from breakable_equivalence import TINY
    from dsv4_kernels import reference as kernel_reference

    from sglang.srt.layers.attention import deepseek_v4_backend

    runner = ModelRunner(cpu_server_args(**TINY, enable_breakable_cuda_graph=True,
                                         breakable_cuda_graph_tokens=[16]))
    core_rows, topk_tokens = [], []
    real_core, real_topk = kernel_reference.sparse_attn_with_sink, deepseek_v4_backend.select_topk

    def core_spy(q, *args, out, **kwargs):
        core_rows.append((q.shape[0], out.shape[0]))
        return real_core(q, *args, out=out, **kwargs)

    def topk_spy(config, index_q, index_weights, keys, meta, page_list, live, *args):
        topk_tokens.append(live)
        return real_topk(config, index_q, index_weights, keys, meta, page_list, live, *args)

    assert runner.attn_backend.kernels == "torch"  # the CPU core is the reference's
    monkeypatch.setattr(kernel_reference, "sparse_attn_with_sink", core_spy)
    monkeypatch.setattr(deepseek_v4_backend, "select_topk", topk_spy)
    fb = _batch(runner, [[5, 6, 7, 8], [9, 10, 11]])
    path = decide_step_path((describe(fb),), runner.graph_tables)
    assert (path.kind, path.size) == (PathKind.BREAKABLE, 16)
    runner.breakable_runner.replay_hidden(fb, path.size)
    ratios = runner.model.config.compress_ratios[:runner.model.config.num_hidden_layers]
    assert core_rows == [(7, 7)] * len(ratios)
    assert topk_tokens == [7] * sum(1 for r in ratios if r == 4) and topk_tokens


def test_harness_catches_a_refresh_that_assigns_a_copy_field(monkeypatch):
    """The replay hook builds copy fields straight into the captured storage; a hook that
    builds them into new storage and then replaces the captured tensor (instead of copy_)
    leaves the graph reading last step's values, which the harness must catch."""
    from sglang.srt.layers.attention.deepseek_v4_backend import DeepseekV4AttnBackend

    def assigns_copy_fields(self, captured, forward_batch, static_forward_batch=None):
        fresh = self._build(static_forward_batch, static=True)  # new storage, not `into`
        DSV4Metadata.refresh_for_breakable_cuda_graph_replay_(captured, fresh)
        # the bug: replace instead of copy_ (positions: RoPE inside segments; raw_out_loc, a
        # staging row per batch row, changes only where the live rows end)
        captured.positions = fresh.positions
        self.forward_metadata = captured

    runners = make_runners(BUCKETS)
    monkeypatch.setattr(DeepseekV4AttnBackend, "prepare_forward_metadata_for_breakable_cuda_graph_replay",
                        assigns_copy_fields)
    report = run_equivalence(runners, BUCKETS, batches_per_bucket=4, seed=2)
    assert any(m.what == "replay vs eager on the padded batch" for m in report.mismatches)


def test_harness_catches_a_segment_that_branches_on_batch_data(monkeypatch):
    from sglang.srt.layers.attention.dsv4 import indexer as indexer_mod
    from sglang.srt.model_executor.forward_context import get_forward_context

    real_forward = indexer_mod.Indexer.forward

    def short_context_shortcut(self, *args, **kwargs):
        # The bug: "short context, the indexer's queries do not matter" decided in Python from
        # the batch. At capture the batch is empty, so the graph freezes the shortcut in.
        q, w = real_forward(self, *args, **kwargs)
        if max(get_forward_context().forward_batch.seq_lens_cpu, default=0) < 64:
            return torch.zeros_like(q), w
        return q, w

    monkeypatch.setattr(indexer_mod.Indexer, "forward", short_context_shortcut)
    runners = make_runners(BUCKETS)
    report = run_equivalence(runners, BUCKETS, batches_per_bucket=6, seed=3)
    assert report.mismatches, "a frozen shortcut must make replay differ from eager"


def test_input_embeds_batches_replay_through_the_static_embeddings_buffer():
    cfg = dict(model_path="dsv4-tiny", context_length=1024, max_total_tokens=8192, max_running_requests=8)
    graph = ModelRunner(cpu_server_args(**cfg, enable_breakable_cuda_graph=True, breakable_cuda_graph_tokens=[32]))
    eager = ModelRunner(cpu_server_args(**cfg))
    ids = torch.randint(3, 500, (27,), generator=torch.Generator().manual_seed(1)).tolist()
    outs = []
    for m in (graph, eager):
        fb = _batch(m, [ids])
        fb.input_embeds = m.model.embed(fb.input_ids) * 0.5  # not the lookup: must be used as given
        outs.append(m.forward(fb).next_token_logits)
    assert graph.breakable_runner.num_replays == 1
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-4)


@pytest.fixture(params=["model_dtype_kv", "fp8_kv"])
def kv_cache_over(request, tmp_path):
    """Runner overrides per KV cache kind. The FP8 cache needs whole 64-dim nope blocks:
    dsv4-tiny with head_dim 80 (64 nope + 16 rope), random weights from its config file."""
    if request.param == "model_dtype_kv":
        return {}
    cfg = get_preset("dsv4-tiny").to_dict()
    cfg["head_dim"] = 80
    path = tmp_path / "dsv4-tiny-head80.json"
    path.write_text(json.dumps(cfg))
    return dict(model_path=str(path), kv_cache_dtype="fp8_e4m3")


def test_segment_kernels_path_replays_and_matches_the_model_torch_path(kv_cache_over):
    """--segment-kernels on routes the in-segment pieces through dsv4_kernels ops (their
    torch references on CPU, Triton on CUDA): same results, and it replays from graphs too,
    with the KV cache in the model dtype or in FP8 rows."""
    buckets = (16, 48)
    over = kv_cache_over
    runners = make_runners(buckets, segment_kernels="on", **over)
    assert all(r.attn_backend.segment_kernels for r in runners)
    assert all((r.kv_pool.fp8_layout is not None) == bool(over) for r in runners)
    batches = 6 if over else 12  # the FP8 case only adds the cache format: fewer batches
    # Replay equals padded eager exactly in both cases. Against unpadded eager, fp32 results
    # may differ in the last bits with the batch's row count (CPU GEMM blocking, which changes
    # between torch versions), and an FP8 cache turns such a difference into a whole e4m3 step
    # when a value sits on a rounding boundary: 0.018 on torch 2.11, 0 on 2.13. A padding row
    # that corrupted real rows would be off by O(1).
    atol = 5e-2 if over else 1e-4
    report = run_equivalence(runners, buckets, batches_per_bucket=batches, seed=4, atol_unpadded=atol)
    assert report.mismatches == [], report.mismatches[:3]
    plain = make_runners(buckets, **over)
    plain_report = run_equivalence(plain, buckets, batches_per_bucket=batches, seed=4, atol_unpadded=atol)
    assert plain_report.tokens == report.tokens
    assert report.max_unpadded_diff < atol and plain_report.max_unpadded_diff < atol


# ---- decode graphs -----------------------------------------------------------------------

def test_decode_graphs_replay_the_same_logits_as_eager_decode():
    cfg = dict(model_path="dsv4-tiny", context_length=1024, max_total_tokens=8192, max_running_requests=12)
    graph = ModelRunner(cpu_server_args(**cfg, cuda_graph_max_bs=8), cuda_graph_on_cpu=True)
    eager = ModelRunner(cpu_server_args(**cfg))
    decode_runner = graph.decode_graph_runner
    assert decode_runner.buckets == [1, 2, 4, 8]
    gen = torch.Generator().manual_seed(0)
    for bs in (1, 3, 4, 6, 8):  # at and between buckets
        slots = [[m.req_to_token_pool.alloc_req() for m in (graph, eager)] for _ in range(bs)]
        lens = torch.randint(5, 300, (bs,), generator=gen).tolist()
        prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in lens]
        for k, m in enumerate((graph, eager)):
            rtp = m.req_to_token_pool
            for s, p in zip(slots, prompts):
                rtp.ensure_capacity(s[k], len(p))
            m.forward(build_forward_batch(ForwardMode.EXTEND, [s[k] for s in slots], [0] * bs, prompts,
                                          "cpu"))
        for step in range(3):
            toks = [[int(t)] for t in torch.randint(3, 500, (bs,), generator=gen)]
            logits = []
            for k, m in enumerate((graph, eager)):
                rtp = m.req_to_token_pool
                for s, n in zip(slots, lens):
                    rtp.ensure_capacity(s[k], n + step + 1)
                fb = build_forward_batch(ForwardMode.DECODE, [s[k] for s in slots], [n + step for n in lens],
                                         toks, "cpu")
                logits.append(m.forward(fb).next_token_logits)
            torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=1e-4)
        for s in slots:
            graph.req_to_token_pool.free_req(s[0])
            eager.req_to_token_pool.free_req(s[1])
    assert decode_runner.num_replays == 15
    assert graph.stats["forward_eager"] == 5  # only the prefills ran eagerly


def test_a_dp_batch_with_an_idle_peer_runs_the_path_it_is_given():
    """Under DP the consensus decides (idle policy "eager": an idle peer sends every rank to
    eager); the runner runs the path it is given and counts the fallback against BCG."""
    from sglang.srt.model_executor.forward_batch_info import DPInfo
    from sglang.srt.model_executor.graph_dispatch import GraphTables, StepInfo

    runner = ModelRunner(cpu_server_args(model_path="dsv4-tiny", context_length=512, max_total_tokens=4096,
                                         max_running_requests=4, enable_breakable_cuda_graph=True,
                                         breakable_cuda_graph_tokens=[8], dp_idle_policy="eager"))
    fb = _batch(runner, [[5, 6, 7, 8, 9]])
    idle = StepInfo(0, int(ForwardMode.IDLE), 0)
    path = decide_step_path([describe(fb), idle], runner.graph_tables)
    assert (path.kind.name, path.reason) == ("EAGER", "inactive_dp_rank")
    replay_policy = GraphTables(runner.graph_tables.breakable_buckets, (), "replay")
    assert decide_step_path([describe(fb), idle], replay_policy).kind.name == "BREAKABLE"
    fb.dp = DPInfo(global_num_tokens_cpu=[5, 0], dp_rank=0)
    runner.forward(fb, path)
    assert runner.get_stats()["breakable_fallbacks"] == {"inactive_dp_rank": 1}
    assert runner.stats["forward_eager"] == 1
