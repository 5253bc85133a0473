"""Captured graphs of one kind, one per bucket, and their replay.

`GraphRunner` holds what both kinds share: static buffers, capture (largest bucket first into
one shared memory pool, after a warm-up), replay, stats, fallback counts and release. Each
kind is a subclass that calls its attention backend's metadata hooks:
- `BreakableCudaGraphRunner` (extend / mixed batches, one graph per token-count bucket):
  segments (projections, norms, RoPE, cache writes, compressors, indexer, MoE) replay from the
  graph while the attention core runs eagerly on the live tokens; the graph starts from the
  static embeddings buffer.
- `DecodeCudaGraphRunner` (decode batches, one graph per batch-size bucket): the whole
  forward, attention included, is one graph (static-shape decode metadata; padded rows read
  and write nothing).
The live batch is padded to its bucket (graph_batch.py); the logits head runs eagerly on the
live rows. Which kind and bucket a step uses is decided elsewhere (graph_dispatch.py).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from contextlib import nullcontext
from typing import Dict, Optional, Sequence

import torch

from sglang.srt.model_executor.breakable_cuda_graph import (
    break_ops_inline,
    create_breakable_graph,
    graph_memory_pool,
)
from sglang.srt.model_executor.breakable_cuda_graph.intermediates import pool_reserved_bytes
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.model_executor.forward_context import forward_context
from sglang.srt.model_executor.graph_batch import StaticBatchBuffers
from sglang.srt.model_executor.graph_dispatch import PathKind, bucket_for

logger = logging.getLogger(__name__)


class GraphRunner:
    """The shared capture / replay / bucket logic; subclasses supply the metadata hooks."""

    kind: PathKind
    name: str  # prefix of the stats keys and of log lines
    buckets_are_tokens: bool  # token-count buckets (breakable) or batch-size buckets (decode)

    def __init__(self, model_runner, buckets: Sequence[int], debug: bool = False):
        self.model_runner = model_runner
        self.model = model_runner.model
        self.attn_backend = model_runner.attn_backend
        self.device = model_runner.device
        self.debug = debug
        buckets = sorted(set(buckets))
        if not buckets or buckets[0] < 1:
            raise ValueError(f"{self.name} buckets must be positive sizes, got {buckets}")
        self.buckets = buckets
        self.buffers = StaticBatchBuffers(buckets[-1], model_runner.config.hidden_size,
                                          model_runner.req_to_token_pool.padding_slot, model_runner.dtype, self.device)
        self.graphs: Dict[int, object] = {}
        self.outputs: Dict[int, torch.Tensor] = {}
        self.captured_metadata: Dict[int, object] = {}
        self.fallbacks: Counter = Counter()  # eager steps this kind would have run, by reason
        self.replays_by_bucket: Counter = Counter()
        self.capture_seconds = 0.0
        self.graph_memory_bytes = 0
        self.capture_memory_bytes = 0
        # Per bucket, in capture order (largest first): the graph pool's growth and the
        # seconds its capture took. Later buckets mostly reuse the first one's pool blocks, so
        # their growth says what each smaller bucket really costs.
        self.graph_memory_by_bucket: Dict[int, int] = {}
        self.capture_seconds_by_bucket: Dict[int, float] = {}
        self.capturing: Optional[int] = None

    # ---- what each kind defines -----------------------------------------------------------
    def init_capture_metadata(self, static_fb: ForwardBatch):
        """The attention metadata the bucket's graph is captured with (kept per bucket)."""
        raise NotImplementedError

    def replay_metadata(self, captured, fb: ForwardBatch, static_fb: ForwardBatch) -> None:
        """Refresh the bucket's captured metadata from the live batch and make it active."""
        raise NotImplementedError

    def _capture_batch(self, bucket: int) -> ForwardBatch:
        """The padding-only static batch the bucket is captured with."""
        raise NotImplementedError

    def _live_rows(self, fb: Optional[ForwardBatch], bucket: int) -> int:
        """Rows the break ops treat as live (capture: fb is None)."""
        raise NotImplementedError

    def _graph_embeds(self, bucket: int) -> Optional[torch.Tensor]:
        """The graph's input embeddings, None when it starts from token ids."""
        return None

    def _capture_mode(self):
        """Context the capture runs in (break ops splitting or inline)."""
        return nullcontext()

    def _model_forward(self, static_fb: ForwardBatch, bucket: int):
        """What the graph captures: the target model over the static batch (its hidden states)."""
        return self.model(static_fb.input_ids, self._graph_embeds(bucket))

    @property
    def num_replays(self) -> int:
        return sum(self.replays_by_bucket.values())

    def bucket_for(self, size: int) -> Optional[int]:
        return bucket_for(self.buckets, size)

    # ---- capture --------------------------------------------------------------------------
    def capture(self) -> None:
        pool = graph_memory_pool(self.device)  # None on CPU: every pool figure is 0 there
        free_before, pool_before = _free_memory(self.device), _pool_bytes(pool)
        pool_now = pool_before
        for bucket in _progress(list(reversed(self.buckets)), self.device, f"{self.name} capture"):
            self.capturing = bucket  # named by the out-of-memory error (memory_report.capture_oom_error)
            start = time.perf_counter()
            self._capture_one(bucket, pool)
            self.capture_seconds_by_bucket[bucket] = time.perf_counter() - start
            pool_before_bucket, pool_now = pool_now, _pool_bytes(pool)
            self.graph_memory_by_bucket[bucket] = max(0, pool_now - pool_before_bucket)
        self.capturing = None
        self.capture_seconds = sum(self.capture_seconds_by_bucket.values())
        # graph memory: what the graphs' pool grew by; capture memory: all the device memory the
        # capture took, the allocator's cache of eager warm-ups and breaks included
        self.graph_memory_bytes = sum(self.graph_memory_by_bucket.values())
        self.capture_memory_bytes = max(0, free_before - _free_memory(self.device))
        logger.info("captured %d %s graphs (%s) in %.1fs: graph pool %.1f MiB, device memory taken %.1f MiB; "
                    "per bucket, largest first: %s", len(self.graphs), self.name, self.buckets,
                    self.capture_seconds, self.graph_memory_bytes / 2**20, self.capture_memory_bytes / 2**20,
                    ", ".join(f"{b}: {self.graph_memory_by_bucket[b] / 2**20:.1f} MiB "
                              f"{self.capture_seconds_by_bucket[b]:.2f}s" for b in self.graph_memory_by_bucket))

    def _capture_one(self, bucket: int, pool) -> None:
        self.buffers.fill(None, bucket)
        static_fb = self._capture_batch(bucket)
        metadata = self.init_capture_metadata(static_fb)
        dp_moe = self.model_runner.dp_moe(bucket)  # DP: the MoE collectives are captured too
        with torch.inference_mode(), forward_context(static_fb, self.attn_backend, self._live_rows(None, bucket),
                                                     dp_moe), self._capture_mode():
            # Warm-up outside the capture (JIT compiles, cuBLAS workspaces, allocator blocks for
            # this bucket's shapes): twice for the first bucket, which meets every kernel for the
            # first time, once for the others. Warm-ups were most of the capture time at Flash
            # dims (three eager forwards per bucket).
            for _ in range(2 if self.device.type == "cuda" and not self.graphs else 1):
                self._model_forward(static_fb, bucket)
            graph = create_breakable_graph(self.device, pool=pool, debug=self.debug)
            with graph.capture():
                out = self._model_forward(static_fb, bucket)
        self.graphs[bucket] = graph
        self.outputs[bucket] = out
        self.captured_metadata[bucket] = metadata

    # ---- replay ---------------------------------------------------------------------------
    def replay_hidden(self, fb: ForwardBatch, bucket: int) -> torch.Tensor:
        """Pad into the bucket's static batch, refresh its metadata, replay; returns the
        bucket's hidden states (rows [:fb.num_tokens] are the live ones)."""
        static_fb = self._fill(fb, bucket)
        self.replay_metadata(self.captured_metadata[bucket], fb, static_fb)
        with forward_context(static_fb, self.attn_backend, self._live_rows(fb, bucket),
                             self.model_runner.dp_moe(bucket)):
            self.graphs[bucket].replay()
        self.replays_by_bucket[bucket] += 1
        return self.outputs[bucket]

    def _fill(self, fb: ForwardBatch, bucket: int) -> ForwardBatch:
        self.buffers.fill(fb, bucket)
        return self.buffers.forward_batch(fb, bucket)

    def count_fallback(self, reason: str, fb: ForwardBatch) -> None:
        """An eager step this kind would have run (graph_dispatch's reason); logged at info
        once per reason: a log line per step is too many."""
        self.fallbacks[reason] += 1
        level = logging.INFO if self.fallbacks[reason] == 1 else logging.DEBUG
        logger.log(level, "%s fallback to eager (%s): %d tokens, %s", self.name, reason, fb.num_tokens,
                   fb.forward_mode.name)

    # ---- bookkeeping ----------------------------------------------------------------------
    def static_buffer_bytes(self) -> int:
        """Bytes of what the graphs read and write outside their pool: the static batch buffers
        and every bucket's captured metadata (allocated before capture, so not in the pool's
        growth). This is what must not scale with the context length (long-context contract)."""
        return tensor_bytes([vars(self.buffers), list(self.captured_metadata.values())])

    def get_stats(self) -> dict:
        p = self.name
        return {
            f"{p}_replays": self.num_replays,
            f"{p}_replays_by_bucket": {str(b): n for b, n in sorted(self.replays_by_bucket.items())},
            f"{p}_fallbacks": dict(self.fallbacks),
            f"{p}_buckets": list(self.buckets),
            f"{p}_capture_seconds": round(self.capture_seconds, 3),
            f"{p}_graph_memory_bytes": self.graph_memory_bytes,
            f"{p}_capture_memory_bytes": self.capture_memory_bytes,
            f"{p}_static_buffer_bytes": self.static_buffer_bytes(),
            # keyed like replays_by_bucket; in capture order, largest bucket first
            f"{p}_graph_memory_by_bucket": {str(b): n for b, n in self.graph_memory_by_bucket.items()},
            f"{p}_capture_seconds_by_bucket": {str(b): round(s, 3) for b, s in self.capture_seconds_by_bucket.items()},
        }

    def release(self) -> None:
        for g in self.graphs.values():
            g.release()
        self.graphs.clear()
        self.outputs.clear()
        self.captured_metadata.clear()


class BreakableCudaGraphRunner(GraphRunner):
    """Extend / mixed batches: one breakable graph per token-count bucket, the attention core
    running eagerly between segments on the live tokens only."""

    kind = PathKind.BREAKABLE
    name = "breakable"
    buckets_are_tokens = True

    def init_capture_metadata(self, static_fb: ForwardBatch):
        backend = self.attn_backend
        if backend.use_captured_forward_metadata_for_breakable_cuda_graph:
            return backend.init_forward_metadata_for_breakable_cuda_graph_capture(static_fb)
        backend.init_forward_metadata(static_fb)
        return None

    def replay_metadata(self, captured, fb: ForwardBatch, static_fb: ForwardBatch) -> None:
        backend = self.attn_backend
        if backend.use_captured_forward_metadata_for_breakable_cuda_graph:
            backend.prepare_forward_metadata_for_breakable_cuda_graph_replay(captured, fb, static_forward_batch=static_fb)
        else:  # a backend that did not opt in is initialised eagerly before each replay
            backend.init_forward_metadata(static_fb)

    def _capture_batch(self, bucket: int) -> ForwardBatch:
        return self.buffers.forward_batch(None, bucket)

    def _live_rows(self, fb: Optional[ForwardBatch], bucket: int) -> int:
        return 0 if fb is None else fb.num_tokens  # the break ops see an empty batch at capture

    def _graph_embeds(self, bucket: int) -> torch.Tensor:
        return self.buffers.input_embeds[:bucket]

    def _fill(self, fb: ForwardBatch, bucket: int) -> ForwardBatch:
        static_fb = super()._fill(fb, bucket)
        if fb.input_embeds is None:  # the lookup the graph does not contain
            torch.index_select(self.model.embed.weight, 0, fb.input_ids, out=self.buffers.input_embeds[:fb.num_tokens])
        return static_fb

    def forward_padded_eager(self, fb: ForwardBatch, bucket: Optional[int] = None) -> torch.Tensor:
        """The replay's exact computation without the graph (same padding, same static
        metadata shapes, same kernels). Replay must match it bit for bit, which separates
        capture bugs from rounding (the equivalence tests compare against it)."""
        bucket = self.bucket_for(fb.num_tokens) if bucket is None else bucket
        static_fb = self._fill(fb, bucket)
        self.attn_backend.init_forward_metadata_for_breakable_cuda_graph_capture(static_fb)
        with torch.inference_mode(), forward_context(static_fb, self.attn_backend, fb.num_tokens):
            return self.model(static_fb.input_ids, self.buffers.input_embeds[:bucket])


class DecodeCudaGraphRunner(GraphRunner):
    """Decode batches: one full CUDA graph per batch-size bucket, the attention core captured
    too (break ops inline), so every metadata tensor is refreshed in place at replay."""

    kind = PathKind.DECODE_GRAPH
    name = "decode_graph"
    buckets_are_tokens = False

    def init_capture_metadata(self, static_fb: ForwardBatch):
        return self.attn_backend.init_forward_metadata_capture_cuda_graph(static_fb)

    def replay_metadata(self, captured, fb: ForwardBatch, static_fb: ForwardBatch) -> None:
        self.attn_backend.init_forward_metadata_replay_cuda_graph(captured, static_fb)

    def _capture_batch(self, bucket: int) -> ForwardBatch:
        return self.buffers.forward_batch(None, bucket, ForwardMode.DECODE)

    def _live_rows(self, fb: Optional[ForwardBatch], bucket: int) -> int:
        return bucket  # the graph attends every row; padded rows have empty lists

    def _capture_mode(self):
        return break_ops_inline()


def tensor_bytes(value, seen: Optional[set] = None) -> int:
    """Bytes of the distinct storages of every tensor in `value` (dataclasses, dicts, lists)."""
    seen = set() if seen is None else seen
    if isinstance(value, torch.Tensor):
        key = value.untyped_storage().data_ptr()
        if key in seen or value.device.type == "meta":
            return 0
        seen.add(key)
        return value.untyped_storage().nbytes()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = [getattr(value, f.name) for f in dataclasses.fields(value)]
    elif isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v, seen) for v in value)
    return 0


def _pool_bytes(pool) -> int:
    return pool_reserved_bytes(pool) if pool is not None else 0


def _free_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return 0


def _progress(items, device, desc):
    """tqdm bar showing the bucket being captured and free device memory."""
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover - tqdm is a runtime dependency
        return items
    bar = tqdm(items, desc=desc, leave=False, disable=None)

    def gen():
        for item in bar:
            bar.set_postfix(bucket=item, free_gib=round(_free_memory(device) / 2**30, 1))
            yield item

    return gen()
