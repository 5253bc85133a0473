"""Programmatic dependent launch (PDL) for the kernels of a decode layer.

A decode step is a chain of some 28 small launches per layer; between two of them the GPU
drains the first, flushes its writes and only then starts scheduling the second. With PDL
(Hopper and later) a kernel is launched while its predecessor still runs: its programs become
resident and wait at `gdc_wait` until the predecessor has finished and its writes are visible,
so the next launch's scheduling overlaps the previous one's tail. Inside CUDA graphs the
launches become programmatic edges.

The contract of a kernel that takes `PDL`:
- its first statement is `pdl.enter(PDL)`: when PDL is true, every program calls `gdc_wait()`
  before its first global load or store, so nothing it reads or writes races its predecessor,
  then `gdc_launch_dependents()`, which lets its own successor start scheduling (that successor
  waits again in the same way);
- the launcher passes `**pdl.options(t)`, which sets both the constexpr and triton's
  `launch_pdl` where the device supports it and nothing changes elsewhere.

The ordering is transitive: a kernel's wait returns only after its predecessor completed, and
that predecessor could not complete before its own wait returned. Launches without PDL
(torch ops, cuBLAS, humming) keep the full stream order on both sides.

On with `SGLANG_DSV4_PDL=1` on SM90 and later; off by default until a GPU run has measured
what it saves and run the kernel tests with it; never on CPU or under the interpreter. Never
inside CUDA-graph capture either: with programmatic launches in it, the capture of the first
graph failed (torch 2.11, Triton 3.6, an H100: "operation failed due to a previous error during
capture"), so a captured launch stays stream-ordered and only eager launches are programmatic.
"""

import functools
import logging
import os

import torch
import triton
import triton.language as tl

try:  # triton >= 3.3
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - torch >= 2.11 ships a triton that has them
    gdc_launch_dependents = gdc_wait = None

__all__ = ["ENV", "enter", "enabled", "options"]

ENV = "SGLANG_DSV4_PDL"

logger = logging.getLogger(__name__)


def _triton_launches_pdl() -> bool:
    """Whether this triton's CUDA launcher takes `launch_pdl` (an unknown launch keyword would
    fail every kernel launch, so without it PDL stays off)."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return gdc_wait is not None and "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


@triton.jit
def enter(PDL: tl.constexpr):
    """A PDL-aware kernel's first statement: wait for the predecessor, then let the successor start."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@functools.lru_cache(maxsize=None)
def _device_supports(index: int) -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1" or os.environ.get(ENV, "0") != "1":
        return False
    if not _triton_launches_pdl():
        logger.warning("%s=1 ignored: triton %s cannot launch with programmatic dependent launch", ENV,
                       triton.__version__)
        return False
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(t: torch.Tensor) -> bool:
    """Whether launches for `t`'s device use programmatic dependent launch."""
    return t.is_cuda and _device_supports(t.device.index if t.device.index is not None else torch.cuda.current_device())


def options(t: torch.Tensor) -> dict:
    """Launch keywords of a PDL-aware kernel: the `PDL` constexpr, and triton's `launch_pdl` when
    on and the stream is not being captured (module docstring)."""
    if enabled(t) and not torch.cuda.is_current_stream_capturing():
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}
