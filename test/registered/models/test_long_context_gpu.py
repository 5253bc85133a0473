"""A 128K-token prompt through chunked prefill with breakable graphs on one GPU: it runs, every
chunk replays, the last logits match the same chunks run eagerly, and the graph memory and the
step metadata of a chunk (replayed and eager) are the same as at an 8K context. Prints time,
throughput and peak memory for docs/benchmarks.md (-s).

Model: dsv4-mini with its maximum position raised to 256K (default), or any preset through
DSV4_LONG_MODEL / DSV4_LONG_NUM_LAYERS, e.g. Flash dims with release-format dummy weights
(FP8 linears, FP4 experts):  DSV4_LONG_MODEL=dsv4-flash DSV4_LONG_NUM_LAYERS=20 pytest -m gpu -s <this file>
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dsv4_harness import Session, run_step  # noqa: E402

from sglang.srt.configs.presets import get_preset  # noqa: E402
from sglang.srt.configs.presets import write_config  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode, build_forward_batch  # noqa: E402
from sglang.srt.model_executor.graph_dispatch import eager_path  # noqa: E402
from sglang.srt.model_executor.graph_runner import tensor_bytes  # noqa: E402
from sglang.srt.model_executor.model_runner import ModelRunner  # noqa: E402
from sglang.test.runner_args import cpu_server_args  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PROMPT = 128 * 1024
CHUNK = 4096
GiB = 1024**3


def _model_path(tmp_path) -> tuple[str, dict]:
    name = os.environ.get("DSV4_LONG_MODEL", "dsv4-mini")
    layers = os.environ.get("DSV4_LONG_NUM_LAYERS")
    config = get_preset(name)
    if config.max_position_embeddings < PROMPT + CHUNK:
        write_config(dataclasses.replace(config, max_position_embeddings=256 * 1024, extra=dict(config.extra)),
                     str(tmp_path))
        name = str(tmp_path)
    return name, dict(num_layers=int(layers)) if layers else {}


def _runner(model_path, context_length, **kw):
    return ModelRunner(cpu_server_args(
        model_path=model_path, load_format="dummy", dtype="bfloat16", device="cuda", context_length=context_length,
        max_total_tokens=context_length + CHUNK, max_running_requests=2, chunked_prefill_size=CHUNK,
        enable_breakable_cuda_graph=True, breakable_cuda_graph_tokens=[CHUNK], breakable_cuda_graph_max_tokens=CHUNK,
        disable_cuda_graph=True, **kw))


def _prefill(runner, tokens, eager: bool) -> torch.Tensor:
    s = Session(runner)
    try:
        for i in range(0, len(tokens), CHUNK):
            chunk = tokens[i:i + CHUNK]
            if not eager:
                last = run_step(runner, [s], [chunk]).next_token_logits[0]
                continue
            rtp = runner.req_to_token_pool
            rtp.ensure_capacity(s.slot, s.length + len(chunk))
            fb = build_forward_batch(ForwardMode.EXTEND, [s.slot], [s.length], [chunk], runner.device)
            last = runner.forward(fb, eager_path(fb)).next_token_logits[0]
            s.length += len(chunk)
        return last.float()
    finally:
        s.release()


def test_128k_prompt_chunked_prefill_with_breakable_graphs(tmp_path):
    model_path, extra = _model_path(tmp_path)
    runner = _runner(model_path, PROMPT + CHUNK, **extra)
    vocab = runner.config.vocab_size
    tokens = torch.randint(2, vocab, (PROMPT,), generator=torch.Generator().manual_seed(0)).tolist()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    replayed = _prefill(runner, tokens, eager=False)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() - base
    assert runner.breakable_runner.num_replays == PROMPT // CHUNK  # every chunk from the graph
    # the last chunk's metadata, at positions 124K..128K
    long_meta = [tensor_bytes(runner.attn_backend.forward_metadata)]
    start = time.perf_counter()
    eager = _prefill(runner, tokens, eager=True)
    torch.cuda.synchronize()
    eager_s = time.perf_counter() - start
    long_meta.append(tensor_bytes(runner.attn_backend.forward_metadata))
    cos = F.cosine_similarity(replayed, eager, dim=0).item()
    graph_mem = runner.breakable_runner.graph_memory_bytes
    static_mem = runner.breakable_runner.static_buffer_bytes()
    # Not a speed comparison: the replayed pass runs first, so it pays every first-time Triton
    # compile of this prompt's shapes and widths; the eager pass after it runs warm.
    print(f"[128K prefill] {model_path} {extra or ''}: BCG first pass {elapsed:.2f}s ({PROMPT / elapsed:.0f} tok/s), "
          f"eager second pass {eager_s:.2f}s ({PROMPT / eager_s:.0f} tok/s); peak transient {peak / GiB:.2f} GiB; graph memory "
          f"{graph_mem / GiB:.3f} GiB; KV pool {runner.kv_pool.nbytes() / GiB:.2f} GiB; replay vs eager cosine {cos:.5f}")
    assert cos > 0.99 and replayed.argmax() == eager.argmax()
    runner.shutdown()
    del runner
    torch.cuda.empty_cache()
    if extra:  # capturing a second model at Flash dims would not fit beside the first
        return
    short = _runner(model_path, 8192)
    # The graphs' own buffers (static batch + captured metadata, outside the pool) must not
    # grow with the context. The pool's growth cannot be compared here: this second runner
    # captures into the process's shared pool, which the first one already grew.
    short_static = short.breakable_runner.static_buffer_bytes()
    print(f"[128K prefill] static graph buffers at 8K context {short_static / 2**20:.1f} MiB vs "
          f"{static_mem / 2**20:.1f} MiB at 132K; graph pool of the 132K runner {graph_mem / GiB:.3f} GiB")
    assert static_mem <= 1.1 * short_static + 16 * 2**20
    # The step metadata of a chunk holds nothing context-sized either: a first chunk at the 8K
    # context has exactly the bytes of the last one at 128K, replayed and eager (before: the c4
    # and c128 candidate slots, 4096 x 33K int32 = 568 MB at 128K vs 16 MB here).
    short_meta = []
    for eager_step in (False, True):
        _prefill(short, tokens[:CHUNK], eager=eager_step)
        short_meta.append(tensor_bytes(short.attn_backend.forward_metadata))
    print(f"[128K prefill] step metadata (replayed, eager) at 8K context {[b / 2**20 for b in short_meta]} MiB "
          f"vs {[b / 2**20 for b in long_meta]} MiB at 132K")
    assert short_meta == long_meta
    short.shutdown()
