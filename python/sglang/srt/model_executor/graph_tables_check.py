"""Start-up agreement of the DP ranks' graph tables, before any capture.

Capture runs the MoE collectives once per bucket, so ranks started with different graph
buckets would abort gloo (or hang NCCL) inside capture; the runner compares the tables first
and fails on every rank with both lists named. Here, not in model_executor/dp_sync.py (which uses
it too), because the model runner calls it and model_executor never imports managers.
"""

from __future__ import annotations

from typing import List, Optional

from sglang.srt.model_executor.graph_dispatch import GraphTables


class DPConsensusError(RuntimeError):
    """DP ranks would take different paths (or hold different graph tables)."""


def gather_graph_tables(group, dp_size: int, tables: GraphTables) -> List[GraphTables]:
    """Every rank's tables (collective over `group`: every rank calls it at the same point)."""
    import torch.distributed as dist

    out: List[Optional[GraphTables]] = [None] * dp_size
    dist.all_gather_object(out, tables, group=group)
    return out


def require_same_capture_tables(group, dp_size: int, tables: GraphTables) -> None:
    """Start-up, before capture (which runs the MoE collectives once per bucket): raises
    `DPConsensusError` naming each rank's buckets on every rank when they differ. The idle
    policy is not compared here: it changes no capture, and a step it would split fails in
    `DPStepSync.decide` with both paths named."""
    ranks = gather_graph_tables(group, dp_size, tables)
    if len({(t.breakable_buckets, t.decode_bs_buckets) for t in ranks}) > 1:
        named = "; ".join(f"rank {r}: breakable {tuple(t.breakable_buckets)}, decode {tuple(t.decode_bs_buckets)}"
                          for r, t in enumerate(ranks))
        raise DPConsensusError(f"DP ranks have different graph buckets ({named}); every rank must be started "
                               "with the same graph flags (--breakable-cuda-graph-tokens, --cuda-graph-max-bs, ...)")
