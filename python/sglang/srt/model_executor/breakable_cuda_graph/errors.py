"""Errors raised by breakable CUDA graphs: capture-time misuse and replay-time staleness."""


class GraphCaptureError(RuntimeError):
    """Something inside a captured segment cannot be captured (host sync, data-dependent
    shape), or a break op broke its contract (returned a value)."""


class BreakableGraphStaleError(RuntimeError):
    """A break op's tensor argument no longer matches what was captured (debug mode): the
    segments around it still read and write the old storage, so replay would be wrong."""
