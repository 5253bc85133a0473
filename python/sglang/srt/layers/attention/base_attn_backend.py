"""Attention backend interface, including the breakable-CUDA-graph hooks (docs/design.md, contract 3)."""

from __future__ import annotations

from typing import Any, Optional


class AttentionBackend:
    # Opt-in: when True, the breakable-graph runner captures one metadata object per bucket and, before
    # each replay, asks the backend to refresh it from the live batch (the captured object
    # stays the active metadata). Backends that do not opt in get init_forward_metadata()
    # before each replay, like an eager step.
    use_captured_forward_metadata_for_breakable_cuda_graph: bool = False

    forward_metadata: Any = None

    def init_forward_metadata(self, forward_batch) -> None:
        raise NotImplementedError

    def init_forward_metadata_for_breakable_cuda_graph_capture(self, forward_batch) -> Any:
        """Metadata whose tensors a breakable-graph capture will record; becomes active."""
        self.init_forward_metadata(forward_batch)
        return self.forward_metadata

    def prepare_forward_metadata_for_breakable_cuda_graph_replay(
        self, capture_metadata: Any, forward_batch, static_forward_batch: Optional[Any] = None
    ) -> None:
        """Refresh `capture_metadata` for the live batch and make it active."""
        raise NotImplementedError(
            f"{type(self).__name__} does not opt in to captured metadata for breakable CUDA graphs"
        )

    # Full decode CUDA graphs (one graph per batch-size bucket; the attention core is captured
    # too, so every metadata tensor is refreshed in place at replay).
    def init_forward_metadata_capture_cuda_graph(self, forward_batch) -> Any:
        """Static-shape metadata a decode-graph capture will record; becomes active."""
        raise NotImplementedError(f"{type(self).__name__} has no decode CUDA graph support")

    def init_forward_metadata_replay_cuda_graph(self, capture_metadata: Any, static_forward_batch) -> None:
        """Write the live batch's metadata into `capture_metadata` in place; make it active."""
        raise NotImplementedError(f"{type(self).__name__} has no decode CUDA graph support")
