"""`bench_one_batch --dp-size N`: the same benchmark on N DP-attention ranks, one process each.

Rank r runs on cuda:r (NCCL) or on the CPU (gloo), joins the DP groups, builds the same
model with 1/N of the routed experts (parallel_state / ModelRunner, as a server's rank), and
runs bench_one_batch's rows on its own batch of `--num-tokens` tokens. Every timed step is a
real DP step (`model_executor/dp_sync.dp_step`: the consensus exchange, then the forward with the
MoE's collectives), so all ranks step together: eager by request (`requested_eager_path`),
BCG as the consensus decides (a step that does not replay a graph is an error). The ideal
graph is captured on every rank at once with the MoE collectives inside it (NCCL in CUDA
graphs; gloo ops recorded by the CPU emulator); it replays without the consensus exchange,
which is host work.

The comm column is the step's MoE collectives: one more eager step of each rank's forward
under torch.profiler (every rank profiles, so the profiler's overhead does not skew one rank
against the others), then `collective_ms` of rank 0's events; comm % is that over the eager
step's median. On GPUs that includes each rank's wait at a collective for a late peer. The
xfer column excludes it: the same collectives at the step's shapes run back to back from a
barrier (`comm_transfer_ms`), times the MoE layers; xfer % is that over the eager step.
Rank 0 prints the table and writes --result-file; the parent process returns rank 0's result.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
from typing import List, Optional, Sequence

import torch

from sglang.bench_one_batch_steps import Steps, ideal_graph, median, run_bench, server_args_for, timed

# A rank that fails leaves the others waiting in a collective until --dp-timeout; after this
# long they are stopped instead.
FAILED_RANK_GRACE_S = 15.0


def collective_ms(events: Sequence, on_cuda: bool) -> float:
    """Milliseconds of collective work among torch.profiler `events` (FunctionEvents).
    CUDA: device-side kernels whose name contains "nccl" (waits for a late peer included:
    that is what the step spends in them). CPU: gloo's `gloo:<collective>` ranges, which span
    a collective on gloo's thread from start to completion; the `c10d::` ops that launch them
    only enqueue, so counting both would count the enqueue twice."""
    from torch.autograd import DeviceType

    total_us = 0.0
    for e in events:
        name = e.name.lower()
        if on_cuda:
            hit = e.device_type == DeviceType.CUDA and "nccl" in name
        else:
            hit = e.device_type == DeviceType.CPU and name.startswith("gloo:")
        if hit:
            total_us += e.time_range.elapsed_us()
    return total_us / 1e3


class _ProfiledForward:
    """The runner as `dp_step` sees it, its forward run under torch.profiler."""

    def __init__(self, runner):
        self.runner = runner
        self.events: list = []

    def forward(self, fb, path):
        from torch.profiler import ProfilerActivity, profile

        cuda = self.runner.device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            out = self.runner.forward(fb, path)
            if cuda:
                torch.cuda.synchronize()
        self.events = list(prof.events())
        return out


class DPSteps(Steps):
    """bench_one_batch's steps on one DP rank: every step through `dp_step` with the others."""

    def __init__(self, runner, groups):
        from sglang.srt.model_executor.dp_sync import DPStepSync

        super().__init__(runner)
        self.rank, self.dp_size = groups.dp_rank, groups.dp_size
        self.group = groups.cpu_group
        self.sync = DPStepSync(groups.cpu_group, self.rank, self.dp_size, runner.graph_tables)

    def eager(self, fb):
        from sglang.srt.model_executor.dp_sync import dp_step
        from sglang.srt.model_executor.graph_dispatch import requested_eager_path

        return lambda: dp_step(self.runner, fb, self.sync, requested_eager_path)

    def graph(self, fb, want):
        from sglang.srt.model_executor.dp_sync import dp_step

        def step():
            path, _ = dp_step(self.runner, fb, self.sync)
            if path.kind != want:  # the same on every rank: the path is agreed
                raise RuntimeError(f"the DP step took path {path.kind.name} ({path.reason}), not {want.name}")

        return step

    def ideal(self, fb):
        # every rank has fb.num_tokens rows: that is the MoE's common pad length
        return ideal_graph(self.runner, fb, self.runner.dp_moe(fb.num_tokens))

    def comm_ms(self, fb) -> Optional[float]:
        from sglang.srt.model_executor.dp_sync import dp_step
        from sglang.srt.model_executor.graph_dispatch import requested_eager_path

        profiled = _ProfiledForward(self.runner)
        dp_step(profiled, fb, self.sync, requested_eager_path)
        return collective_ms(profiled.events, self.runner.device.type == "cuda")

    def comm_transfer_ms(self, fb, iters: int, repeats: int, warmup: int) -> float:
        """The step's MoE collectives alone, at its shapes: the dispatcher's dispatch (rows and
        routing gathered) and combine (expert outputs reduce-scattered) of one MoE layer, run
        back to back on every rank after a barrier, times the model's MoE layers (every DSV4
        layer has one). The ranks do nothing else in between, so none waits for a late peer:
        unlike comm_ms, this is the collectives' own time."""
        import torch.distributed as dist

        r, n = self.runner, fb.num_tokens
        ctx = r.dp_moe(n)
        k, d = r.config.num_experts_per_tok, r.config.hidden_size
        x = torch.zeros(n, d, dtype=r.dtype, device=r.device)
        weights = torch.zeros(n, k, dtype=torch.float32, device=r.device)
        ids = torch.zeros(n, k, dtype=torch.int64, device=r.device)
        expert_out = torch.zeros(n * self.dp_size, d, dtype=torch.float32, device=r.device)  # the experts' fp32 sums

        def one_layer():
            ctx.dispatcher.combine(ctx, expert_out, ctx.dispatcher.dispatch(ctx, x, weights, ids))

        dist.barrier(group=self.group)
        runs = timed(one_layer, r.device, iters=iters, repeats=repeats, warmup=warmup)
        return median(runs) * len(r.model.layers)

    def gather(self, value) -> list:
        import torch.distributed as dist

        out: List = [None] * self.dp_size
        dist.all_gather_object(out, value, group=self.group)
        return out


def rank_main(rank: int, world: int, port: int, a: argparse.Namespace, out_dir: str) -> None:
    """Body of one rank process; rank 0 saves its result as out_dir/rank0.json. An error
    propagates (the process exits non-zero with the traceback on stderr)."""
    from sglang.srt.distributed.parallel_state import destroy_dp_groups, init_dp_groups
    from sglang.srt.model_executor.model_runner import ModelRunner

    # The ranks share the host's cores: each taking all of them makes their thread pools
    # fight (as in scheduler_process._init_dp). An explicit OMP_NUM_THREADS wins.
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if a.device == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    groups = init_dp_groups(rank, world, f"tcp://127.0.0.1:{port}", device, a.dp_timeout)
    runner = ModelRunner(server_args_for(a, world), cuda_graph_on_cpu="decode" in a.modes)
    try:
        result = run_bench(a, runner, DPSteps(runner, groups))
    finally:
        runner.shutdown()  # graphs first, then the process group (destroying it under live graphs hangs)
    if rank == 0:
        with open(os.path.join(out_dir, "rank0.json"), "w") as f:
            json.dump(result, f)
    del runner, groups
    gc.collect()
    destroy_dp_groups()


def _wait(procs, timeout_s: float) -> None:
    """Join every rank; once one has failed, stop the rest after a grace period (they would
    otherwise wait in a collective until --dp-timeout)."""
    deadline = time.monotonic() + timeout_s
    failed_at = None
    while any(p.is_alive() for p in procs):
        for p in procs:
            p.join(timeout=0.2)
        now = time.monotonic()
        if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
            failed_at = now
        if now > deadline or (failed_at is not None and now - failed_at > FAILED_RANK_GRACE_S):
            for p in procs:
                if p.is_alive():
                    p.terminate()
            for p in procs:
                p.join(timeout=10)
            return


def run_dp(a: argparse.Namespace, timeout_s: float = 24 * 3600.0) -> dict:
    """Spawns `a.dp_size` rank processes, waits for them, returns rank 0's result with every
    rank's exit code (`rank_exitcodes`). A rank that failed (or hung past `timeout_s`) is a
    RuntimeError naming it; its traceback is on stderr."""
    import torch.multiprocessing as mp

    from sglang.test.server_process import free_port

    if a.device not in ("cuda", "cpu"):
        raise ValueError(f"--dp-size {a.dp_size} puts rank r on cuda:r (or on the CPU): pass --device cuda or "
                         f"--device cpu, not {a.device!r}")
    if a.device == "cuda" and torch.cuda.device_count() < a.dp_size:
        raise ValueError(f"--dp-size {a.dp_size} needs {a.dp_size} GPUs (one per rank), found "
                         f"{torch.cuda.device_count()}")
    # NVLink multicast hung on the H200 hosts this was built on (docs/design.md); the ranks inherit it.
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    port = free_port()
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="bench_one_batch_dp_") as out_dir:
        procs = [ctx.Process(target=rank_main, args=(r, a.dp_size, port, a, out_dir)) for r in range(a.dp_size)]
        for p in procs:
            p.start()
        _wait(procs, timeout_s)
        codes = [p.exitcode for p in procs]
        if any(c != 0 for c in codes):
            bad = ", ".join(f"rank {r}: {'hung (stopped)' if c is None or c < 0 else f'exit {c}'}"
                            for r, c in enumerate(codes) if c != 0)
            raise RuntimeError(f"bench_one_batch --dp-size {a.dp_size} failed ({bad}); see the ranks' stderr")
        with open(os.path.join(out_dir, "rank0.json")) as f:
            result = json.load(f)
    result["rank_exitcodes"] = codes
    return result
