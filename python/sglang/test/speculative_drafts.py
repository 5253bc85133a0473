"""Test-only drafts for MTPSpeculator.draft_override: random-weight models accept almost no draft
of their own, so tests drive acceptance with drafts read from a plain run's outputs."""

from __future__ import annotations

from typing import Callable, List, Optional


def reference_drafts(continuation: Callable, wrong_at: Optional[Callable[[int], int]] = None):
    """Drafts equal to `continuation(req)` (the tokens a plain greedy run generated for that
    request) at the drafts' output positions, padded with token 2 past its end: all accepted.
    With wrong_at(first draft position) -> offset, the draft at that offset (when there is one)
    is another token, so it and every later one are rejected."""

    def override(req, first_pos: int, drafts: List[int]) -> List[int]:
        start = first_pos - len(req.origin_input_ids)  # output index of the first draft
        d = list(continuation(req)[start:start + len(drafts)])
        d += [2] * (len(drafts) - len(d))
        m = wrong_at(first_pos) if wrong_at is not None else len(d)
        if m < len(d):
            d[m] ^= 1
        return d
    return override
