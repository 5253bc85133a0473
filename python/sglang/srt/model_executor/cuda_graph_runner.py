"""Full CUDA graphs for decode batches: one graph per batch-size bucket, attention included.

Decode attention has static shapes (index lists padded with -1, lengths as tensors), so the
whole forward is one graph; padded rows read nothing and write nothing. Extend and mixed
batches never use these graphs (they go to the breakable runner or run eagerly).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import Counter
from typing import Dict, List, Optional

import torch

from sglang.srt.layers.logits_processor import LogitsOutput, compute_logits
from sglang.srt.model_executor.breakable_cuda_graph import (
    break_ops_inline,
    create_breakable_graph,
    graph_memory_pool,
)
from sglang.srt.model_executor.breakable_cuda_graph_runner import _progress
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.model_executor.forward_context import forward_context
from sglang.srt.model_executor.graph_batch import StaticBatchBuffers

logger = logging.getLogger(__name__)


def default_capture_bs(max_bs: int) -> List[int]:
    ladder = [1, 2, 4, 8, 12, 16, 24, 32] + list(range(48, max_bs + 1, 16))
    return sorted({b for b in ladder if b <= max_bs} | {max_bs})


class CudaGraphRunner:
    def __init__(self, model_runner, max_bs: int, debug: bool = False):
        self.model_runner = model_runner
        self.model = model_runner.model
        self.attn_backend = model_runner.attn_backend
        self.device = model_runner.device
        self.debug = debug
        rtp = model_runner.req_to_token_pool
        self.capture_bs = default_capture_bs(min(max_bs, rtp.max_num_reqs))
        self.max_bs = self.capture_bs[-1]
        self.buffers = StaticBatchBuffers(self.max_bs, self.max_bs, model_runner.config.hidden_size,
                                          rtp.padding_slot, rtp.req_to_token.dtype, model_runner.dtype, self.device)
        self.graphs: Dict[int, object] = {}
        self.outputs: Dict[int, torch.Tensor] = {}
        self.metadata: Dict[int, object] = {}
        self.num_replays = 0
        self.replays_per_bs: Counter = Counter()
        self.fallbacks: Counter = Counter()
        self.capture_seconds = 0.0

    def capture(self) -> None:
        pool = graph_memory_pool(self.device)
        start = time.perf_counter()
        for bs in _progress(list(reversed(self.capture_bs)), self.device, "decode graph capture"):
            self.buffers.fill(None, bs, bs)
            fb = self.buffers.forward_batch(None, bs, 0, ForwardMode.DECODE)
            self.metadata[bs] = self.attn_backend.init_forward_metadata_capture_cuda_graph(fb)
            # num_live_tokens = bs: the graph attends every row; padded rows have empty lists.
            dp_moe = self.model_runner.dp_moe(bs)
            with torch.inference_mode(), forward_context(fb, self.attn_backend, bs, dp_moe), break_ops_inline():
                for _ in range(2 if self.device.type == "cuda" else 1):
                    self.model(fb.input_ids)
                graph = create_breakable_graph(self.device, pool=pool, debug=self.debug)
                with graph.capture():
                    self.outputs[bs] = self.model(fb.input_ids)
            self.graphs[bs] = graph
        self.capture_seconds = time.perf_counter() - start
        logger.info("captured %d decode graphs (bs %s) in %.1fs", len(self.graphs), self.capture_bs,
                    self.capture_seconds)

    def fallback_reason(self, fb: ForwardBatch) -> Optional[str]:
        if not fb.forward_mode.is_decode():
            return "not_decode"
        if fb.batch_size > self.max_bs:
            return "batch_too_large"
        if fb.input_embeds is not None:
            return "input_embeds"
        return None

    def can_run(self, fb: ForwardBatch) -> bool:
        reason = self.fallback_reason(fb)
        if reason is not None and reason != "not_decode":
            self.fallbacks[reason] += 1
        return reason is None

    def replay_hidden(self, fb: ForwardBatch, bs: Optional[int] = None) -> torch.Tensor:
        if bs is None:
            bs = self.capture_bs[bisect.bisect_left(self.capture_bs, fb.batch_size)]
        self.buffers.fill(fb, bs, fb.batch_size)
        static_fb = self.buffers.forward_batch(fb, bs, fb.batch_size)
        self.attn_backend.init_forward_metadata_replay_cuda_graph(self.metadata[bs], static_fb)
        with forward_context(static_fb, self.attn_backend, bs, self.model_runner.dp_moe(bs)):
            self.graphs[bs].replay()
        self.num_replays += 1
        self.replays_per_bs[bs] += 1
        return self.outputs[bs]

    def replay(self, fb: ForwardBatch) -> LogitsOutput:
        return compute_logits(self.model, self.replay_hidden(fb), fb)

    def get_stats(self) -> dict:
        return {"decode_graph_replays": self.num_replays,
                "decode_graph_replays_per_bs": dict(sorted(self.replays_per_bs.items())), "decode_graph_fallbacks": dict(self.fallbacks),
                "decode_graph_bs": list(self.capture_bs)}

    def release(self) -> None:
        for g in self.graphs.values():
            g.release()
        self.graphs.clear()
        self.outputs.clear()
        self.metadata.clear()
