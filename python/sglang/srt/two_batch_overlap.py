"""Two-batch overlap (TBO) under DP attention: split a step's batch into two micro-batches so
that one's MoE gather/scatter overlaps the other's compute.

Not implemented yet. `--enable-two-batch-overlap` fails at start-up (server-args validation)
with NotImplementedError rather than running without overlap while claiming to overlap. With
it off, the only supported setting, the DP preparation calls `compute_split_index`, which
returns None at once: no split index is computed for any batch, and mixed batches never
have one.
"""

from __future__ import annotations

from typing import Optional

NOT_IMPLEMENTED = ("two-batch overlap is not implemented yet: drop --enable-two-batch-overlap "
                   "(DP attention runs each step as one batch)")


def check_two_batch_overlap(enabled: bool) -> None:
    """Called while validating the server arguments."""
    if enabled:
        raise NotImplementedError(NOT_IMPLEMENTED)


def compute_split_index(forward_batch, enabled: bool) -> Optional[int]:
    """The request index where the batch splits into two micro-batches, or None (no split).
    Off: returns before looking at the batch."""
    if not enabled:
        return None
    raise NotImplementedError(NOT_IMPLEMENTED)
