"""Process groups for DP attention: a device group (NCCL on GPUs, gloo on CPU) for the
collectives around the MoE, and a gloo CPU group for the per-step consensus exchange."""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass
from typing import Optional

import torch

logger = logging.getLogger(__name__)


@dataclass
class DPGroups:
    dp_rank: int
    dp_size: int
    device_group: object
    cpu_group: object


_groups: Optional[DPGroups] = None


def init_dp_groups(dp_rank: int, dp_size: int, init_method: str, device: torch.device,
                   timeout_s: float = 300.0) -> DPGroups:
    """Every wait is bounded by `timeout_s`: a rank that disagrees or dies ends in an error."""
    import torch.distributed as dist

    global _groups
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=dp_rank, world_size=dp_size, timeout=timeout)
    device_group = dist.group.WORLD
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else device_group
    _groups = DPGroups(dp_rank, dp_size, device_group, cpu_group)
    logger.info("DP rank %d/%d joined (%s)", dp_rank, dp_size, backend)
    return _groups


def get_dp_groups() -> Optional[DPGroups]:
    return _groups


def destroy_dp_groups() -> None:
    """Call only after every captured graph is released: destroying a process group under
    live graphs hangs (seen with NCCL)."""
    import torch.distributed as dist

    global _groups
    if _groups is not None and dist.is_initialized():
        dist.destroy_process_group()
    _groups = None
