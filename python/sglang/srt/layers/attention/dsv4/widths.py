"""Widths of the per-token candidate lists (c4 entries the indexer scores, c128 entries
attention reads) and of the indexer's working set. One place, so the metadata builder, the
attention break and the memory planner agree.

Breakable graphs never hold a list whose width follows the context length: the lists and the
indexer's top-k over them are read only by the eager attention break, sized to the live
batch (its longest sequence). Only full decode graphs, which capture the attention core too,
keep static widths of context_length / ratio, for at most `cuda_graph_max_bs` rows.
"""

from __future__ import annotations

# Bytes the eager indexer top-k may use for one chunk of query tokens: gathered keys, per-head
# logits and scores of every candidate of every token in the chunk.
INDEXER_WORKSPACE_BYTES = 256 * 1024 * 1024


def candidate_widths(max_seq_len: int) -> tuple[int, int]:
    """(c4 width, c128 width) of the candidate lists for sequences up to `max_seq_len`."""
    return max(1, max_seq_len // 4), max(1, max_seq_len // 128)


def indexer_bytes_per_candidate(config, kernels: bool) -> int:
    """Working-set bytes per (token, candidate) of the indexer top-k. The Triton kernel keeps
    one fp32 logit (plus torch.topk's scratch); the torch version gathers the key and scores
    every head, in fp32."""
    return 12 if kernels else 4 * (config.index_head_dim + config.index_n_heads + 2)


def indexer_chunk_tokens(config, c4_width: int, kernels: bool, budget: int | None = None) -> int:
    """Query tokens per chunk of the eager indexer top-k, so its working set stays under
    `budget` (default INDEXER_WORKSPACE_BYTES) whatever the context length."""
    budget = INDEXER_WORKSPACE_BYTES if budget is None else budget
    return max(1, budget // (c4_width * indexer_bytes_per_candidate(config, kernels)))
