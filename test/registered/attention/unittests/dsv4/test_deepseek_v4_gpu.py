"""Breakable CUDA graphs with real CUDA graphs on dsv4-mini in bf16 (H200; marker gpu).

Replay must equal an eager run of the same padded batch exactly; against the unpadded eager
run we report max |diff| and greedy agreement (bf16 rounding through the indexer's top-k)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

sys.path.insert(0, os.path.dirname(__file__))
from breakable_equivalence import make_runners, run_equivalence  # noqa: E402

MINI = dict(model_path="dsv4-mini", device="cuda", dtype="bfloat16", context_length=2048,
            max_total_tokens=96 * 1024, max_running_requests=12)
BUCKETS = (64, 256, 1024)


@pytest.mark.parametrize("debug", [False, True], ids=["plain", "debug"])
def test_real_cuda_graph_replay_equals_padded_eager_on_dsv4_mini(debug):
    runners = make_runners(BUCKETS, **dict(MINI, debug_cuda_graph=debug))
    report = run_equivalence(runners, BUCKETS, batches_per_bucket=12 if debug else 40, seed=5,
                             max_len=1800, atol_unpadded=float("inf"))
    print(f"\nbatches={report.batches} modes={report.modes} "
          f"max|replay - unpadded eager| (hidden, bf16)={report.max_unpadded_diff:.4f}")
    assert [m for m in report.mismatches if m.what.startswith("replay vs eager on the padded")] == []
    for r in runners:
        r.shutdown()


def test_triton_attention_matches_torch_reference_on_dsv4_mini():
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.test.runner_args import cpu_server_args

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "models"))
    from dsv4_harness import prefill_in_chunks

    tok = torch.randint(3, 30000, (700,), generator=torch.Generator().manual_seed(0)).tolist()
    out = {}
    for kernels in ("torch", "triton"):  # triton: attention core and segment kernels
        r = ModelRunner(cpu_server_args(**dict(MINI, attention_backend=kernels, disable_cuda_graph=True)))
        out[kernels] = torch.stack(prefill_in_chunks(r, tok, [300, 1]))[-8:]
        r.shutdown()
    a, b = out["torch"].float(), out["triton"].float()
    cos = torch.nn.functional.cosine_similarity(a, b, dim=-1)
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    print(f"\ntriton vs torch: max|diff|={(a - b).abs().max().item():.4f} min cos={cos.min().item():.5f} "
          f"argmax agreement={agree:.2f}")
    assert cos.min().item() > 0.99


def test_model_torch_code_in_segments_on_dsv4_mini():
    """--segment-kernels off (the model's own torch code inside segments, Triton attention
    core): replay == padded eager exactly there too."""
    runners = make_runners(BUCKETS, **dict(MINI, segment_kernels="off"))
    assert not any(r.attn_backend.segment_kernels for r in runners)
    report = run_equivalence(runners, BUCKETS, batches_per_bucket=12, seed=6, max_len=1800,
                             atol_unpadded=float("inf"))
    print(f"\ntorch segments: batches={report.batches} max|replay - unpadded eager|={report.max_unpadded_diff:.4f}")
    assert [m for m in report.mismatches if m.what.startswith("replay vs eager on the padded")] == []
    for r in runners:
        r.shutdown()


def test_breakable_replay_never_waits_for_the_gpu():
    """Dispatch, building metadata, padding, replaying and the logits head queue work without a single
    host sync, so the host prepares step i+1 while the GPU runs step i."""
    from sglang.bench_one_batch_steps import make_batch
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.test.runner_args import cpu_server_args

    r = ModelRunner(cpu_server_args(**dict(MINI, enable_breakable_cuda_graph=True, breakable_cuda_graph_tokens=[64],
                                             disable_cuda_graph=True)))
    assert r.attn_backend.segment_kernels  # the default on CUDA
    fb, _ = make_batch(r, "mixed", 60, 300, 1024, 8)  # 9 requests: max_running_requests is 12
    with torch.inference_mode():
        r.forward(fb)  # first use: lazy allocations outside the checked replay
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = r.forward(fb).next_token_logits  # dispatch included
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert got.shape == (fb.batch_size, r.config.vocab_size) and torch.isfinite(got).all()
    assert r.breakable_runner.num_replays == 2
    r.shutdown()
