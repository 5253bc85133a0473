"""Host -> device copies that never wait for the GPU.

A copy from pageable host memory makes the CPU wait until the stream has drained, which
serialises the host's metadata work with the previous step's kernels. Pinned memory lets the
copy be queued; torch's caching host allocator keeps the pinned block alive until the copy
has run, so the host tensor can be dropped at once.
"""

from __future__ import annotations

import torch


def to_device_async(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
