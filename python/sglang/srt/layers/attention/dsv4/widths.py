"""Widths of the per-token candidate lists under graphs: how many c4 entries the indexer
scores and how many c128 entries attention reads for one query token, as static shapes.
One place, so the metadata builder and the memory planner agree."""

from __future__ import annotations


def candidate_widths(config, context_length: int) -> tuple[int, int]:
    """(c4 width, c128 width) of graph-captured candidate lists for `context_length`."""
    return max(1, context_length // 4), max(1, context_length // 128)
