"""DP-attention step consensus: before every forward, ranks all-gather their step
descriptions and derive the step's path from them with the one decider
(model_executor/graph_dispatch.py), so every rank takes the same path (same graph bucket,
or all eager) and the collectives around the MoE stay in step.

This exchange is the only collective a step adds. With `verify=True` (debug mode) a second
tiny all-gather checks that every rank really took the same decision and raises an error
naming the step and the ranks instead of letting mismatched collectives hang.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from sglang.srt.layers.logits_processor import LogitsOutput
from sglang.srt.model_executor.forward_batch_info import DPInfo, ForwardBatch
from sglang.srt.model_executor.graph_dispatch import (
    GraphTables,
    PathKind,
    StepInfo,
    StepPath,
    decide_step_path,
    describe,
)


class DPConsensusError(RuntimeError):
    pass


class DPStepSync:
    def __init__(self, group, dp_rank: int, dp_size: int, tables: GraphTables, verify: bool = False):
        self.group = group
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.tables = tables
        self.verify = verify
        self.step = 0
        self.last_path = -1

    def exchange(self, local: StepInfo) -> List[StepInfo]:
        import torch.distributed as dist

        local = StepInfo(local.num_tokens, local.mode, local.batch_size, local.has_input_embeds, self.last_path)
        mine = torch.tensor(local.to_row(), dtype=torch.int64)
        out = torch.empty(self.dp_size * mine.numel(), dtype=torch.int64)
        dist.all_gather_into_tensor(out, mine, group=self.group)
        infos = [StepInfo.from_row(r) for r in out.view(self.dp_size, -1).tolist()]
        previous = {i.last_path for i in infos}
        if len(previous) > 1:  # a rank took another path last step: its collectives went astray
            self._raise("previous step", {r: i.last_path for r, i in enumerate(infos)})
        return infos

    def decide(self, infos: Sequence[StepInfo], decide_fn=decide_step_path) -> StepPath:
        path = decide_fn(infos, self.tables)
        if self.verify:
            self._verify(path)
        self.last_path = path.code()
        self.step += 1
        return path

    def _verify(self, path: StepPath) -> None:
        import torch.distributed as dist

        mine = torch.tensor([self.step, path.code()], dtype=torch.int64)
        out = torch.empty(self.dp_size * 2, dtype=torch.int64)
        dist.all_gather_into_tensor(out, mine, group=self.group)
        rows = out.view(self.dp_size, 2).tolist()
        if len({tuple(r) for r in rows}) > 1:
            self._raise(f"step {self.step}", {r: row[1] for r, row in enumerate(rows)})

    def _raise(self, when: str, codes: dict) -> None:
        def describe(code: int) -> str:
            if code < 0:
                return "none"
            return f"{PathKind(code // 1_000_000).name.lower()}({code % 1_000_000})"

        taken = ", ".join(f"rank {r}: {describe(c)}" for r, c in codes.items())
        raise DPConsensusError(f"DP ranks disagree on the forward path at {when} (this is step {self.step}): {taken}")



def dp_step(model_runner, fb: ForwardBatch, sync: DPStepSync,
            decide_fn=decide_step_path) -> Tuple[StepPath, Optional[LogitsOutput]]:
    """One DP-attention step of one rank: exchange descriptions, agree the path, run it.
    Idle ranks pass an empty IDLE batch and still join every collective; the logits are
    None when no rank had work (nobody ran a forward). Used by the scheduler and the tests'
    DP harness alike; `decide_fn` exists so a test can make one rank disagree."""
    path = sync.decide(sync.exchange(describe(fb)), decide_fn)
    if path.kind == PathKind.IDLE:
        return path, None
    fb.dp = DPInfo(global_num_tokens_cpu=list(path.global_num_tokens), dp_rank=sync.dp_rank)
    return path, model_runner.forward(fb, path)
