"""Small driver for model tests: runs requests through a ModelRunner with explicit chunking."""

from __future__ import annotations

from typing import List, Sequence

import torch

from sglang.srt.model_executor.forward_batch_info import ForwardMode, build_forward_batch


class Session:
    """One request's KV state inside a runner."""

    def __init__(self, runner):
        self.runner = runner
        self.slot = runner.req_to_token_pool.alloc_req()
        self.length = 0

    def release(self):
        self.runner.req_to_token_pool.free_req(self.slot)


def run_step(runner, sessions: Sequence[Session], chunks: Sequence[Sequence[int]], mode=None,
             return_all_logits=False):
    """Feed one chunk per session in a single forward; returns the LogitsOutput."""
    rtp = runner.req_to_token_pool
    for s, c in zip(sessions, chunks):
        rtp.ensure_capacity(s.slot, s.length + len(c))
    if mode is None:
        mode = ForwardMode.DECODE if all(len(c) == 1 and s.length > 0 for s, c in zip(sessions, chunks)) \
            else ForwardMode.EXTEND
    fb = build_forward_batch(mode, [s.slot for s in sessions], [s.length for s in sessions],
                             [list(c) for c in chunks], runner.device,
                             return_all_logits=return_all_logits)
    out = runner.forward(fb)
    for s, c in zip(sessions, chunks):
        s.length += len(c)
    return out


def prefill_in_chunks(runner, tokens: Sequence[int], chunk_sizes: Sequence[int]) -> List[torch.Tensor]:
    """Prefill `tokens` with the given chunk sizes (the last repeats); logits after each chunk."""
    s = Session(runner)
    out, i, k = [], 0, 0
    while i < len(tokens):
        n = chunk_sizes[min(k, len(chunk_sizes) - 1)]
        out.append(run_step(runner, [s], [tokens[i:i + n]]).next_token_logits[0])
        i += n
        k += 1
    s.release()
    return out
