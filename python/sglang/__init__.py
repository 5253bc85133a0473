"""DeepSeek-V4 serving runtime: breakable CUDA graphs for extend/mixed batches under DP attention."""

__version__ = "0.1.0"


def __getattr__(name: str):
    # Engine pulls in the model, scheduler and torch.distributed; importing it lazily keeps
    # `import sglang` cheap and independent of whether the entrypoints are built yet.
    if name == "Engine":
        from sglang.srt.entrypoints.engine import Engine

        return Engine
    raise AttributeError(f"module 'sglang' has no attribute {name!r}")
