"""Widths of the c4 / c128 candidates of a step (c4 entries the indexer scores, c128 entries
attention reads) and of the indexer's working set. One place, so the metadata builder, the
attention break and the memory planner agree.

No per-token candidate list is materialized: the kernels read each candidate through the page
table (dsv4_kernels PageTableList), so the step metadata holds only per-token lengths and
these widths (host ints). A width bounds the indexer's logits of one chunk of query tokens
(and the torch reference's gathered lists of that chunk): the live batch's longest sequence /
ratio, or context_length / ratio in full decode graphs, which capture the attention core.
"""

from __future__ import annotations

# Bytes the eager indexer top-k may use for one chunk of query tokens: gathered keys, per-head
# logits and scores of every candidate of every token in the chunk.
INDEXER_WORKSPACE_BYTES = 256 * 1024 * 1024


def candidate_widths(max_seq_len: int) -> tuple[int, int]:
    """(c4 width, c128 width): the most c4 / c128 entries a token of a sequence of up to
    `max_seq_len` tokens sees."""
    return max(1, max_seq_len // 4), max(1, max_seq_len // 128)


def indexer_bytes_per_candidate(config, kernels: bool) -> int:
    """Working-set bytes per (token, candidate) of the indexer top-k. The Triton kernel reads
    the candidates from the page table and keeps one int64 top-k key (plus torch.topk's
    scratch);
    the torch version gathers the chunk's candidate slots from the page table (int64 index
    math, then the int32 list: 20 bytes), then the keys, and scores every head, in fp32."""
    return 12 if kernels else 4 * (config.index_head_dim + config.index_n_heads + 2) + 20


def indexer_chunk_tokens(config, c4_width: int, kernels: bool, budget: int | None = None) -> int:
    """Query tokens per chunk of the eager indexer top-k, so its working set stays under
    `budget` (default INDEXER_WORKSPACE_BYTES) whatever the context length."""
    budget = INDEXER_WORKSPACE_BYTES if budget is None else budget
    return max(1, budget // (c4_width * indexer_bytes_per_candidate(config, kernels)))
