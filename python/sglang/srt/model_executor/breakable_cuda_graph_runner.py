"""BreakableCudaGraphRunner: extend and mixed batches replayed from breakable graphs.

One graph per token-count bucket, captured largest first into one shared memory pool.
The live batch is padded to its bucket; segments (projections, norms, RoPE, cache writes,
compressors, indexer, MoE) replay from the graph while the attention core runs eagerly on
the real tokens. The logits head runs eagerly on the live rows. Decode batches never come
here: they have full CUDA graphs (cuda_graph_runner.py).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import Counter
from typing import Dict, List, Optional, Sequence

import torch

from sglang.srt.layers.logits_processor import LogitsOutput, compute_logits
from sglang.srt.model_executor.breakable_cuda_graph import create_breakable_graph, graph_memory_pool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.model_executor.forward_context import forward_context
from sglang.srt.model_executor.graph_batch import StaticBatchBuffers

logger = logging.getLogger(__name__)


def default_capture_num_tokens(max_tokens: int) -> List[int]:
    """Fine-grained for small counts, coarser above; consecutive buckets differ by at most
    2x, so padding never exceeds the real token count."""
    ladder = [1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 80, 96, 112, 128]
    step, n = 32, 128
    while n < max_tokens:
        if n >= 256 * (step // 32) and step < 512:
            step *= 2
        n += step
        ladder.append(n)
    return sorted({min(x, max_tokens) for x in ladder if x <= max_tokens} | {max_tokens})


def _has_inactive_dp_rank(forward_batch: ForwardBatch) -> bool:
    """True when DP attention is on and some rank has no tokens this step."""
    dp = forward_batch.dp
    return dp is not None and any(n == 0 for n in dp.global_num_tokens_cpu)


class BreakableCudaGraphRunner:
    def __init__(self, model_runner, capture_num_tokens: Optional[Sequence[int]] = None,
                 max_tokens: int = 512, debug: bool = False):
        self.model_runner = model_runner
        self.model = model_runner.model
        self.attn_backend = model_runner.attn_backend
        self.device = model_runner.device
        self.debug = debug
        buckets = sorted(set(capture_num_tokens)) if capture_num_tokens else default_capture_num_tokens(max_tokens)
        if not buckets or buckets[0] < 1:
            raise ValueError(f"breakable CUDA graph token buckets must be positive, got {buckets}")
        self.capture_num_tokens = buckets
        self.max_num_tokens = buckets[-1]
        rtp = model_runner.req_to_token_pool
        self.buffers = StaticBatchBuffers(
            self.max_num_tokens, rtp.max_num_reqs + 1, model_runner.config.hidden_size, rtp.padding_slot,
            loc_dtype=rtp.req_to_token.dtype, embed_dtype=model_runner.dtype, device=self.device,
        )
        self.graphs: Dict[int, object] = {}
        self.outputs: Dict[int, torch.Tensor] = {}
        self.attn_metadata_buffers: Dict[int, object] = {}
        self.num_replays = 0
        self.replays_per_bucket: Counter = Counter()  # shows a batch replaying a needlessly large bucket
        self.fallbacks: Counter = Counter()
        self.capture_seconds = 0.0
        self.graph_memory_bytes = 0

    # ---- capture --------------------------------------------------------------------------
    def capture(self) -> None:
        pool = graph_memory_pool(self.device)
        start = time.perf_counter()
        free_before = _free_memory(self.device)
        for bucket in _progress(list(reversed(self.capture_num_tokens)), self.device, "BCG capture"):
            self._capture_one(bucket, pool)
        self.capture_seconds = time.perf_counter() - start
        self.graph_memory_bytes = max(0, free_before - _free_memory(self.device))
        logger.info("captured %d breakable graphs (%s tokens) in %.1fs, %.1f MiB",
                    len(self.graphs), self.capture_num_tokens, self.capture_seconds, self.graph_memory_bytes / 2**20)

    def _capture_one(self, bucket: int, pool) -> None:
        self.buffers.fill(None, bucket, 0)
        static_fb = self.buffers.forward_batch(None, bucket, 0)
        metadata = self._init_forward_metadata_for_capture(static_fb)
        dp_moe = self.model_runner.dp_moe(bucket)  # DP: the MoE collectives are captured too
        with torch.inference_mode(), forward_context(static_fb, self.attn_backend, 0, dp_moe):
            # The graph starts from the static embeddings buffer: replay fills it from the
            # batch's input_embeds, or by one embedding lookup of its token ids.
            embeds = self.buffers.input_embeds[:bucket]
            for _ in range(2 if self.device.type == "cuda" else 1):  # warm-up outside the capture
                self.model(static_fb.input_ids, embeds)
            graph = create_breakable_graph(self.device, pool=pool, debug=self.debug)
            with graph.capture():
                hidden = self.model(static_fb.input_ids, embeds)
        self.graphs[bucket] = graph
        self.outputs[bucket] = hidden
        self.attn_metadata_buffers[bucket] = metadata

    def _init_forward_metadata_for_capture(self, static_fb: ForwardBatch):
        backend = self.attn_backend
        if backend.use_captured_forward_metadata_for_breakable_cuda_graph:
            return backend.init_forward_metadata_for_breakable_cuda_graph_capture(static_fb)
        backend.init_forward_metadata(static_fb)
        return None

    # ---- replay ---------------------------------------------------------------------------
    def bucket_for(self, num_tokens: int) -> int:
        return self.capture_num_tokens[bisect.bisect_left(self.capture_num_tokens, num_tokens)]

    def fallback_reason(self, fb: ForwardBatch) -> Optional[str]:
        """Why this batch must run eagerly (None: it can replay)."""
        if not fb.forward_mode.is_extend_or_mixed():
            return "not_extend_or_mixed"
        n = fb.num_tokens
        if n > self.max_num_tokens:
            return "too_many_tokens"
        if n == 0:
            return "empty_batch"
        if self.bucket_for(n) - n > 2 * n:
            return "padding_waste"
        if _has_inactive_dp_rank(fb):
            # Under DP attention the step consensus decides instead (forward_dp, idle
            # policies); a batch reaching this single-rank path with an idle peer stays eager.
            return "inactive_dp_rank"
        return None

    def can_run(self, fb: ForwardBatch) -> bool:
        reason = self.fallback_reason(fb)
        if reason is not None and reason != "not_extend_or_mixed":
            self.fallbacks[reason] += 1
            # first time per reason at info, then debug: a fallback is worth knowing about,
            # a log line per step is not
            level = logging.INFO if self.fallbacks[reason] == 1 else logging.DEBUG
            logger.log(level, "breakable graph fallback to eager (%s): %d tokens, %s", reason, fb.num_tokens,
                       fb.forward_mode.name)
        return reason is None

    def replay(self, fb: ForwardBatch) -> LogitsOutput:
        hidden = self.replay_hidden(fb)
        return compute_logits(self.model, hidden, fb)

    def replay_hidden(self, fb: ForwardBatch, bucket: Optional[int] = None) -> torch.Tensor:
        """Pad, refresh metadata, replay; returns the bucket's hidden states (rows [:n] real).
        Under DP attention the bucket comes from the step consensus (largest rank's count)."""
        n = fb.num_tokens
        bucket = self.bucket_for(n) if bucket is None else bucket
        static_fb = self._fill(fb, bucket)
        self._prepare_forward_metadata_for_replay(bucket, fb, static_fb)
        with forward_context(static_fb, self.attn_backend, n, self.model_runner.dp_moe(bucket)):
            self.graphs[bucket].replay()
        self.num_replays += 1
        self.replays_per_bucket[bucket] += 1
        return self.outputs[bucket]

    def forward_padded_eager(self, fb: ForwardBatch) -> torch.Tensor:
        """The replay's exact computation without the graph: same padding, same static
        metadata shapes, same kernels. Replay must match it bit for bit, which separates
        capture bugs from rounding (the equivalence tests compare against it)."""
        n = fb.num_tokens
        bucket = self.bucket_for(n)
        static_fb = self._fill(fb, bucket)
        self.attn_backend.init_forward_metadata_for_breakable_cuda_graph_capture(static_fb)
        with torch.inference_mode(), forward_context(static_fb, self.attn_backend, n):
            return self.model(static_fb.input_ids, self.buffers.input_embeds[:bucket])

    def _fill(self, fb: ForwardBatch, bucket: int) -> ForwardBatch:
        self.buffers.fill(fb, bucket, fb.batch_size)
        if fb.input_embeds is None:  # the lookup the graph does not contain
            n = fb.num_tokens
            torch.index_select(self.model.embed.weight, 0, fb.input_ids, out=self.buffers.input_embeds[:n])
        return self.buffers.forward_batch(fb, bucket, fb.batch_size)

    def _prepare_forward_metadata_for_replay(self, bucket: int, fb: ForwardBatch, static_fb: ForwardBatch) -> None:
        backend = self.attn_backend
        captured = self.attn_metadata_buffers.get(bucket)
        if backend.use_captured_forward_metadata_for_breakable_cuda_graph and captured is not None:
            backend.prepare_forward_metadata_for_breakable_cuda_graph_replay(captured, fb, static_forward_batch=static_fb)
            return
        if backend.use_captured_forward_metadata_for_breakable_cuda_graph:
            logger.warning("no captured attention metadata for bucket %d; building it eagerly", bucket)
        backend.init_forward_metadata(static_fb)

    # ---- bookkeeping ----------------------------------------------------------------------
    def get_stats(self) -> dict:
        return {
            "bcg_replays": self.num_replays,
            "bcg_replays_per_bucket": dict(sorted(self.replays_per_bucket.items())),
            "bcg_fallbacks": dict(self.fallbacks),
            "bcg_buckets": list(self.capture_num_tokens),
            "bcg_capture_seconds": round(self.capture_seconds, 3),
            "bcg_graph_memory_bytes": self.graph_memory_bytes,
        }

    def release(self) -> None:
        for g in self.graphs.values():
            g.release()
        self.graphs.clear()
        self.outputs.clear()
        self.attn_metadata_buffers.clear()


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
