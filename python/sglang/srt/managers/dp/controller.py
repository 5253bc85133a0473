"""DP controller: the server process's side of the scheduler processes, one per DP rank (one
in all without DP attention). A façade over the three concerns, each in its own module:
supervisor (start ranks, accept remote ones, health, shutdown), router (the rank of each
request and the per-rank load) and stats (one dict of all ranks' stats). It has no threads
of its own: its one client (controller_client.ControllerClient, shared by the TokenizerManager
and the offline DP Engine) drives the channels and calls `route`/`on_outputs` from one thread."""

from __future__ import annotations

from typing import Dict, List, Optional

from sglang.srt.managers.dp.router import DPRouter, RankLoad
from sglang.srt.managers.dp.supervisor import SHUTDOWN_GRACE_S, RankChannel, RankSupervisor
from sglang.srt.managers.io_struct import ReadyMsg
from sglang.srt.server_args import resolve_load_balance_method


class DataParallelController:
    def __init__(self, server_args):
        self.supervisor = RankSupervisor(server_args)
        self.router = DPRouter(self.supervisor.dp_size, resolve_load_balance_method(server_args),
                               page_size=server_args.page_size,
                               max_imbalance=server_args.load_balance_max_imbalance)
        self.dp_size = self.supervisor.dp_size

    # ---- supervisor ---------------------------------------------------------------------

    def launch(self, timeout_s: Optional[float] = None) -> ReadyMsg:
        ready = self.supervisor.launch(timeout_s)
        if self.router.method == "cache_aware":  # a rank caches at most its KV pool
            self.router.set_tree_tokens(ready.server_args.max_total_tokens)
        return ready

    @property
    def channels(self) -> List[Optional[RankChannel]]:
        return self.supervisor.channels

    @property
    def pids(self) -> List[Optional[int]]:
        return self.supervisor.pids

    def first_dead_rank(self) -> Optional[int]:
        return self.supervisor.first_dead_rank()

    def death_message(self, rank: int) -> str:
        return self.supervisor.death_message(rank)

    def shutdown(self, timeout_s: Optional[float] = None) -> None:
        self.supervisor.shutdown(SHUTDOWN_GRACE_S if timeout_s is None else timeout_s)

    # ---- router (one thread) ------------------------------------------------------------

    def route(self, req) -> List[tuple]:
        return self.router.route(req)

    def assign(self, req) -> int:
        return self.router.assign(req)

    def owner_of(self, rid: str) -> Optional[int]:
        return self.router.owner_of(rid)

    def on_outputs(self, outs) -> None:
        self.router.on_outputs(outs)

    def release(self, rid: str) -> None:
        self.router.release(rid)

    @property
    def owner(self) -> Dict[str, int]:
        return self.router.owner

    @property
    def load(self) -> List[RankLoad]:
        return self.router.load

    @property
    def num_outstanding(self) -> int:
        return self.router.num_outstanding
