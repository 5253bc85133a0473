"""The most tokens one forward step can carry: the raw-KV staging rows of every layer
(mem_cache/dsv4_kv_pool.py) are sized by it, the memory planner counts them, and the
scheduler never builds a larger step.

A step is a prefill chunk (at most --chunked-prefill-size tokens; without chunking one whole
prompt, at most --context-length), decode rows (at most --max-running-requests), or a mixed
step of both (the chunk shrinks by the decode rows, so it stays within the larger of the
two); a breakable-graph bucket pads a step up to its size, so the largest bucket counts too.
"""

from __future__ import annotations


def max_step_tokens(*, chunked_prefill_size: int, context_length: int, max_running_requests: int,
                    breakable_max_tokens: int = 0) -> int:
    """chunked_prefill_size <= 0: no chunking. breakable_max_tokens: the largest breakable-graph
    bucket (0: breakable graphs off). Decode graphs pad to at most max_running_requests rows."""
    chunk = chunked_prefill_size if chunked_prefill_size > 0 else context_length
    return max(chunk, max_running_requests, breakable_max_tokens, 1)
