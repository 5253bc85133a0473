"""Resolved ServerArgs for the small model runners of tests and benchmarks.

ServerArgs is the one source of the runner's settings and defaults (server_args.py). A small
runner differs from a server in a few sizes only; they are stated here once, so a test names
just what it is about: `ModelRunner(cpu_server_args(context_length=512, max_running_requests=4))`.
"""

from __future__ import annotations

import torch

from sglang.srt.server_args import ServerArgs

# A small float32 runner on the CPU, whatever the machine has: these are the sizes the tests
# were written against (the pools, chunk and graph sizes they count on), not server defaults.
SMALL_RUNNER = dict(
    device="cpu",
    dtype="float32",
    context_length=1024,
    max_running_requests=16,
    max_total_tokens=16384,
    chunked_prefill_size=2048,
    breakable_cuda_graph_max_tokens=512,
    cuda_graph_max_bs=16,
)


def cpu_server_args(**overrides) -> ServerArgs:
    """`SMALL_RUNNER` with `overrides` (any ServerArgs field), resolved. A GPU test overrides
    `device="cuda"` (and usually `dtype="bfloat16"`); a CUDA device that is not there is a
    ValueError from resolve(), as for a server; a name that is no ServerArgs field, a TypeError."""
    return ServerArgs(**{**SMALL_RUNNER, **overrides}).resolve(cuda_available=torch.cuda.is_available())
