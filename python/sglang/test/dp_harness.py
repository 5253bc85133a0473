"""Multi-process DP-attention harness: each rank process drives random batches (idle steps,
ineligible batches, mixed/extend/decode) through the real consensus and dp_step, and
records every live row's logits so the parent can compare with one process run eagerly."""

from __future__ import annotations

import contextlib
import gc
import os
import random
import re
import traceback
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from sglang.srt.model_executor.forward_batch_info import ForwardMode, build_forward_batch
from sglang.test.speculative_drafts import reference_drafts
from sglang.test.kv_accounting import free_or_cache_only_pages

TINY_DP = dict(model_path="dsv4-tiny", context_length=1024, max_total_tokens=32768, max_running_requests=10)
BUCKETS = (8, 16, 32, 48)


def device_config(device: str) -> dict:
    """A CUDA rank runs on the device its process selected (torch.cuda.set_device), as a server's."""
    if device == "cuda":
        return dict(TINY_DP, device="cuda", dtype="float32", attention_backend="torch")
    return dict(TINY_DP)


@contextlib.contextmanager
def errors_to(path: str):
    """A rank process's body: any error (its traceback) goes to `path`, where the parent test
    asserts on the text, instead of dying with the child process."""
    try:
        yield
    except BaseException:  # noqa: BLE001 - the parent asserts on the text
        with open(path, "w") as f:
            f.write(traceback.format_exc())


@dataclass
class StepRecord:
    step: int
    rows: List[Tuple[int, int, List[int]]]  # (request id, prefix length, new tokens)
    logits: torch.Tensor  # [rows, vocab]
    path: str


def rank_schedule(seed: int, rank: int, steps: int, max_reqs: int):
    """Deterministic per-rank batches: a list (per step) of [(req_id, n_new_tokens)]."""
    rng = random.Random(seed * 1000 + rank)
    lengths: Dict[int, int] = {}
    next_id = 0
    plan = []
    for _ in range(steps):
        if rng.random() < 0.2:  # idle step for this rank
            plan.append([])
            continue
        rows = []
        live = [r for r, n in lengths.items() if n < 600 and n > 0]
        rng.shuffle(live)
        if live and rng.random() < 0.3:  # a decode step: every running request decodes
            rows = [(r, 1) for r in live[:8]]
            for r, _ in rows:
                lengths[r] += 1
            plan.append(rows)
            continue
        big = rng.random() < 0.1  # ineligible for graphs: more tokens than the largest bucket
        budget = rng.randint(49, 64) if big else rng.randint(1, 48)
        for r in live[: rng.randint(0, 4)]:
            if budget > 0:
                rows.append((r, 1))
                budget -= 1
        active = len([r for r, n in lengths.items() if n < 600])
        while budget > 0 and len(rows) < max_reqs - 1:
            if live and (rng.random() < 0.4 or active >= max_reqs - 2):
                r = live.pop()
                if any(r == x for x, _ in rows):
                    continue
                n = min(budget, rng.randint(2, 40))
            elif active < max_reqs - 2:
                r, next_id, active = next_id, next_id + 1, active + 1
                n = budget if rng.random() < 0.5 else rng.randint(1, budget)
            else:
                break
            rows.append((r, n))
            budget -= n
        order = sorted(rows, key=lambda x: 1 if (x[1] == 1 and lengths.get(x[0], 0) > 0) else 0)
        for r, n in order:
            lengths[r] = lengths.get(r, 0) + n
        # retire long requests so their slots come back
        for r in [r for r, n in lengths.items() if n >= 600]:
            lengths[r] = 10**9
        plan.append(order)
    return plan


def tokens_for(req: int, start: int, n: int) -> List[int]:
    return [(req * 131 + start + j * 17) % 500 + 3 for j in range(n)]


class RequestTable:
    """Maps harness request ids to request slots of one runner, with their lengths."""

    def __init__(self, runner):
        self.runner = runner
        self.slot: Dict[int, int] = {}
        self.length: Dict[int, int] = {}

    def batch(self, rows, **kw):
        """The next step's ForwardBatch. Requests that reached 600 tokens last step are
        freed now, after their last forward ran (freeing zeroes their page-table row)."""
        rtp = self.runner.req_to_token_pool
        for r in [r for r, n in self.length.items() if n >= 600 and r in self.slot]:
            rtp.free_req(self.slot.pop(r))
        for r, n in rows:
            if r not in self.slot:
                self.slot[r] = rtp.alloc_req()
                self.length[r] = 0
            rtp.ensure_capacity(self.slot[r], self.length[r] + n)
        mode = _mode(rows, self.length)
        spec = [(r, self.length[r], tokens_for(r, self.length[r], n)) for r, n in rows]
        fb = build_forward_batch(mode, [self.slot[r] for r, _ in rows], [self.length[r] for r, _ in rows],
                                 [t for _, _, t in spec], self.runner.device, **kw)
        for r, n in rows:
            self.length[r] += n
        return fb, spec


def _mode(rows, lengths) -> ForwardMode:
    if not rows:
        return ForwardMode.IDLE
    dec = [n == 1 and lengths.get(r, 0) > 0 for r, n in rows]
    if all(dec):
        return ForwardMode.DECODE
    return ForwardMode.MIXED if any(dec) else ForwardMode.EXTEND


def dp_rank_main(rank: int, world: int, port: int, steps: int, seed: int, idle_policy: str, out_dir: str,
                 verify: bool = False, disagree_at: Optional[int] = None, timeout_s: float = 60.0,
                 device: str = "cpu", graphs: bool = True) -> None:
    """Body of one DP rank process; writes its records (or its error text) to out_dir.
    device "cuda": rank r on GPU r with NCCL and real CUDA graphs (float32, torch kernels)."""
    torch.set_num_threads(1)
    with errors_to(os.path.join(out_dir, f"rank{rank}.err")):
        from sglang.srt.distributed.parallel_state import destroy_dp_groups, init_dp_groups
        from sglang.srt.model_executor.dp_sync import DPStepSync, dp_step
        from sglang.srt.model_executor.graph_dispatch import PathKind, decide_step_path
        from sglang.srt.model_executor.model_runner import ModelRunner
        from sglang.test.runner_args import cpu_server_args

        if device == "cuda":
            torch.cuda.set_device(rank)
        dev = torch.device(device, rank) if device == "cuda" else torch.device("cpu")
        groups = init_dp_groups(rank, world, f"tcp://127.0.0.1:{port}", dev, timeout_s)
        runner = ModelRunner(cpu_server_args(
            **device_config(device), enable_dp_attention=True, dp_size=world, dp_idle_policy=idle_policy,
            enable_breakable_cuda_graph=graphs, breakable_cuda_graph_tokens=list(BUCKETS),
            disable_cuda_graph=not graphs, cuda_graph_max_bs=8), cuda_graph_on_cpu=graphs)
        sync = DPStepSync(groups.cpu_group, rank, world, runner.graph_tables, verify=verify)
        table = RequestTable(runner)
        records, paths = [], {}
        for step, rows in enumerate(rank_schedule(seed, rank, steps, TINY_DP["max_running_requests"])):
            fb, spec = table.batch(rows)
            decide = decide_step_path
            if disagree_at is not None and step == disagree_at and rank == 1:
                decide = _contrary_decision  # a deliberate bug on one rank
            path, out = dp_step(runner, fb, sync, decide)
            paths[path.kind.name] = paths.get(path.kind.name, 0) + 1
            if path.kind == PathKind.IDLE:
                continue
            if spec:
                records.append(StepRecord(step, spec, out.next_token_logits.float().cpu(), path.kind.name))
        stats = runner.get_stats()
        torch.save(dict(records=records, paths=paths, stats=stats), os.path.join(out_dir, f"rank{rank}.pt"))
        runner.shutdown()  # graphs first, then the process group
        # Nothing may still reference the groups when they are destroyed: a leftover
        # reference can abort the process at exit.
        del runner, sync, groups, table
        gc.collect()
        destroy_dp_groups()


# ---- the scheduler under DP attention, with and without overlap scheduling --------------------


def dp_scheduler_requests(rank: int, vocab: int):
    """Rank 0 serves several requests of different lengths (one needs chunks, one stops on a
    token); rank 1 one short request, so it is idle for most steps and still joins them."""
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    rng = random.Random(100 + rank)
    lengths = [37, 5, 90, 12, 1] if rank == 0 else [6]
    reqs = []
    for i, n in enumerate(lengths):
        params = SamplingParams(max_new_tokens=12 if rank == 0 else 3, temperature=0.0, ignore_eos=True)
        reqs.append(GenerateReqInput(rid=f"rank{rank}-r{i}", input_ids=[rng.randrange(2, vocab) for _ in range(n)],
                                     sampling_params=params))
    return reqs


def run_ranks(target, world: int, out_dir: str, *args, join_timeout_s: float = 400.0, **kwargs) -> dict:
    """Spawn `world` processes of target(rank, world, port, out_dir, *args, **kwargs), wait, and
    return {rank: what it saved in rank{r}.pt}; a hung rank or one that wrote rank{r}.err
    fails the calling test with that error."""
    import torch.multiprocessing as mp

    from sglang.test.server_process import free_port

    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, out_dir, *args), kwargs=kwargs) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=join_timeout_s)
    assert all(not p.is_alive() for p in procs), "a DP rank hung"
    out = {}
    for r in range(world):
        err = os.path.join(out_dir, f"rank{r}.err")
        assert not os.path.exists(err), open(err).read()
        out[r] = torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False)
    return out


def _serve_in_lockstep(sched, sync, group) -> Tuple[dict, list]:
    """Step every rank's scheduler until no rank has work: ({rid: (ids, finish reason)}, the
    agreed path of every step)."""
    import torch.distributed as dist

    results, paths = {}, []
    while True:
        busy = torch.tensor([int(sched.has_work())], dtype=torch.int64)
        dist.all_reduce(busy, op=dist.ReduceOp.MAX, group=group)
        if not busy.item():
            return results, paths
        for o in sched.step(sync):
            ids, _ = results.get(o.rid, ([], None))
            results[o.rid] = (ids + o.new_token_ids, o.finish_reason)
        paths.append(sync.last_path)


def dp_scheduler_rank_main(rank: int, world: int, port: int, out_dir: str, stop_token_of: Optional[dict] = None,
                           timeout_s: float = 60.0) -> None:
    """One DP rank running the real Scheduler (dsv4-tiny, breakable and decode graphs on the
    emulator) through `step(dp_sync)` in lockstep, once with overlap scheduling and once
    without, over the same runner. Saves, per mode, the outputs, every step's agreed path
    and the idle steps this rank joined. `stop_token_of` (rid -> token) adds stop tokens."""
    torch.set_num_threads(1)
    with errors_to(os.path.join(out_dir, f"rank{rank}.err")):
        from sglang.srt.distributed.parallel_state import destroy_dp_groups, init_dp_groups
        from sglang.srt.model_executor.dp_sync import DPStepSync
        from sglang.srt.managers.scheduler import Scheduler
        from sglang.srt.model_executor.forward_batch_info import ForwardMode
        from sglang.srt.model_executor.model_runner import ModelRunner
        from sglang.srt.server_args import ServerArgs
        from sglang.test.runner_args import cpu_server_args

        groups = init_dp_groups(rank, world, f"tcp://127.0.0.1:{port}", torch.device("cpu"), timeout_s)
        cfg = dict(model_path="dsv4-tiny", context_length=512, max_total_tokens=4096)
        runner = ModelRunner(cpu_server_args(**cfg, max_running_requests=6, dp_size=world, enable_dp_attention=True,
                                             enable_breakable_cuda_graph=True, breakable_cuda_graph_tokens=list(BUCKETS),
                                             cuda_graph_max_bs=4), cuda_graph_on_cpu=True)
        out = {}
        for overlap in (True, False):
            args = ServerArgs(**cfg, device="cpu", max_running_requests=6, chunked_prefill_size=32,
                              enable_mixed_chunk=True, disable_overlap_schedule=not overlap)
            args = args.resolve(cuda_available=False)
            sched = Scheduler(args, runner)
            sync = DPStepSync(groups.cpu_group, rank, world, runner.graph_tables)
            for r in dp_scheduler_requests(rank, runner.config.vocab_size):
                if stop_token_of and r.rid in stop_token_of:
                    r.sampling_params.stop_token_ids = [stop_token_of[r.rid]]
                    r.sampling_params.ignore_eos = False
                sched.add_request(r)
            results, paths = _serve_in_lockstep(sched, sync, groups.cpu_group)
            stats = sched.get_stats()
            out[overlap] = dict(results=results, paths=paths, idle_forwards=sched.num_forwards[ForwardMode.IDLE],
                                overlap_steps=stats["num_overlap_steps"], dropped=stats["num_dropped_tokens"],
                                free_pages=(free_or_cache_only_pages(sched), stats["num_total_pages"]))
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
        runner.shutdown()
        del runner, sync, groups, sched
        gc.collect()
        destroy_dp_groups()


def dp_soak_requests(rank: int, vocab: int):
    """A long run for rank 0 (three requests of 400 tokens, one at a time) and two short
    requests for rank 1, idle for almost all of it."""
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.sampling.sampling_params import SamplingParams

    rng = random.Random(200 + rank)
    lengths, n = ([9, 40, 17], 400) if rank == 0 else ([6, 11], 20)
    return [GenerateReqInput(rid=f"rank{rank}-soak{i}", input_ids=[rng.randrange(2, vocab) for _ in range(m)],
                             sampling_params=SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True))
            for i, m in enumerate(lengths)]


def dp_speculative_rank_main(rank: int, world: int, port: int, out_dir: str, ckpt: str, timeout_s: float = 60.0,
                             soak: bool = False) -> None:
    """One DP rank serving DeepSeek's conformance checkpoint (it has an MTP layer) through the
    real Scheduler in lockstep, breakable graphs on the emulator: plain decoding, then MTP
    speculation with the MTP layer's own drafts, then with drafts that are the plain tokens
    except at an offset varying with the position (partial acceptance). Rank 1 serves one
    short request: idle for most steps, it still joins every forward, the MTP layer's graph
    replays too. Saves each run's outputs, agreed paths, idle forwards, speculation counters
    and MTP forwards and replays. `soak`: the requests of dp_soak_requests, one at a time per
    rank, plain and partial acceptance only (hundreds of steps)."""
    torch.set_num_threads(1)
    with errors_to(os.path.join(out_dir, f"rank{rank}.err")):
        from sglang.srt.distributed.parallel_state import destroy_dp_groups, init_dp_groups
        from sglang.srt.managers.scheduler import Scheduler
        from sglang.srt.model_executor.dp_sync import DPStepSync
        from sglang.srt.model_executor.model_runner import ModelRunner
        from sglang.srt.server_args import ServerArgs
        from sglang.test.runner_args import cpu_server_args

        groups = init_dp_groups(rank, world, f"tcp://127.0.0.1:{port}", torch.device("cpu"), timeout_s)
        cfg = dict(model_path=ckpt, context_length=512, max_total_tokens=4096, max_running_requests=1 if soak else 6,
                   chunked_prefill_size=32, enable_mixed_chunk=True, dp_size=world, enable_dp_attention=True)
        graphs = dict(enable_breakable_cuda_graph=True, breakable_cuda_graph_tokens=list(BUCKETS), cuda_graph_max_bs=4)
        spec = dict(speculative_algorithm="mtp", speculative_num_steps=3)
        out = {}
        runs = (("plain", {}), ("partial", spec)) if soak else (("plain", {}), ("mtp", spec), ("partial", spec))
        for name, extra in runs:
            runner = ModelRunner(cpu_server_args(**cfg, **graphs, **extra), cuda_graph_on_cpu=True)
            sched = Scheduler(ServerArgs(**cfg, **extra, device="cpu").resolve(cuda_available=False), runner)
            sync = DPStepSync(groups.cpu_group, rank, world, runner.graph_tables)
            reqs = (dp_soak_requests if soak else dp_scheduler_requests)(rank, runner.config.vocab_size)
            if name == "partial":
                plain = out["plain"]["results"]
                sched.speculator.draft_override = reference_drafts(lambda req: plain[req.rid][0], lambda pos: pos % 3)
            for r in reqs:
                sched.add_request(r)
            results, paths = _serve_in_lockstep(sched, sync, groups.cpu_group)
            stats = sched.get_stats()
            out[name] = dict(results=results, paths=paths, idle_forwards=sched.num_forwards[ForwardMode.IDLE],
                             free_pages=(free_or_cache_only_pages(sched), stats["num_total_pages"]),
                             spec={k: v for k, v in stats.items() if k.startswith("spec_")},
                             breakable_replays=stats.get("breakable_replays", 0),
                             # every module's (mtp_..., mtp1_... with chained modules)
                             mtp_replays={k: sum(v for key, v in stats.items()
                                                 if re.fullmatch(rf"mtp\d*_{k}_replays", key))
                                          for k in ("decode_graph", "breakable")},
                             forward_mtp=stats.get("forward_mtp", 0))
            runner.shutdown()
            del runner, sched, sync
            gc.collect()
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
        del groups
        gc.collect()
        destroy_dp_groups()


# ---- scripted DP steps: ranks with different inputs (consensus tests) --------------------------

def script_infos(script, rank: int):
    """The `StepInfo` each step of a script gives `rank`, derived without a runner: a script
    is a list of steps, each a per-rank `(rows, embeds)` with rows as in `rank_schedule`."""
    from sglang.srt.model_executor.graph_dispatch import StepInfo

    lengths: Dict[int, int] = {}
    infos = []
    for step in script:
        rows, embeds = step[rank]
        infos.append(StepInfo(sum(n for _, n in rows), int(_mode(rows, lengths)), len(rows), embeds and bool(rows)))
        for r, n in rows:
            lengths[r] = lengths.get(r, 0) + n
    return infos


class _CountingRunner:
    """The runner as dp_step sees it, counting forwards (none may run after a disagreement)."""

    def __init__(self, runner):
        self.runner = runner
        self.forwards = 0

    def forward(self, fb, path):
        self.forwards += 1
        return self.runner.forward(fb, path)


def dp_scripted_rank_main(rank: int, world: int, port: int, out_dir: str, script, buckets=BUCKETS,
                          idle_policy: str = "replay", verify: bool = False, local_decide: bool = False, timeout_s: float = 30.0) -> None:
    """One rank running `script` through dp_step; saves, per step, its own description, the
    gathered descriptions and the path, and on `DPConsensusError` its text, the step and the
    forwards run. After the error the rank still passes a barrier and shuts down normally:
    the groups are intact because no mismatched collective was entered. `local_decide`
    injects a deliberately rank-dependent decision (the local description only). A
    `DPConsensusError` at start-up (different buckets, before capture) is saved with step None."""
    torch.set_num_threads(1)
    with errors_to(os.path.join(out_dir, f"rank{rank}.err")):
        import torch.distributed as dist

        from sglang.srt.distributed.parallel_state import destroy_dp_groups, init_dp_groups
        from sglang.srt.model_executor.dp_sync import DPStepSync, dp_step
        from sglang.srt.model_executor.graph_tables_check import DPConsensusError
        from sglang.srt.model_executor.graph_dispatch import decide_step_path, describe
        from sglang.srt.model_executor.model_runner import ModelRunner
        from sglang.test.runner_args import cpu_server_args

        groups = init_dp_groups(rank, world, f"tcp://127.0.0.1:{port}", torch.device("cpu"), timeout_s)
        steps, error, runner = [], None, None
        try:
            runner = ModelRunner(cpu_server_args(
                **device_config("cpu"), enable_dp_attention=True, dp_size=world, dp_idle_policy=idle_policy,
                enable_breakable_cuda_graph=True, breakable_cuda_graph_tokens=list(buckets), cuda_graph_max_bs=8),
                cuda_graph_on_cpu=True)
        except DPConsensusError as e:  # at start-up, before capture
            error = dict(step=None, text=str(e), forwards=0)
            script = []
        if runner is not None:
            sync = DPStepSync(groups.cpu_group, rank, world, runner.graph_tables, verify=verify)
            counting, table = _CountingRunner(runner), RequestTable(runner)
        for i, step in enumerate(script):
            rows, embeds = step[rank]
            fb, _ = table.batch(rows)
            if embeds and rows:
                fb.input_embeds = runner.model.embed.weight[fb.input_ids]
            seen = []

            def decide(infos, tables, seen=seen):
                seen.append(list(infos))
                return decide_step_path([infos[rank]] if local_decide else infos, tables)

            try:
                path, out = dp_step(counting, fb, sync, decide)
            except DPConsensusError as e:
                error = dict(step=i, text=str(e), forwards=counting.forwards)
                break
            steps.append(dict(local=describe(fb), gathered=seen[0], path=path,
                              logits_ok=out is None or bool(torch.isfinite(out.next_token_logits).all())))
        dist.barrier(group=groups.cpu_group)
        torch.save(dict(steps=steps, error=error, forwards=counting.forwards if runner else 0),
                   os.path.join(out_dir, f"rank{rank}.pt"))
        if runner is not None:
            runner.shutdown()
            del sync, table, counting
        del runner, groups
        gc.collect()
        destroy_dp_groups()


def _contrary_decision(infos, tables):
    """Not what decide_step_path says: eager where it says graph, a graph where it says eager."""
    from sglang.srt.model_executor.graph_dispatch import PathKind, StepPath, decide_step_path

    true = decide_step_path(infos, tables)
    tokens = tuple(i.num_tokens for i in infos)
    if true.kind == PathKind.EAGER:
        return StepPath(PathKind.BREAKABLE, tables.breakable_buckets[-1], tokens)
    return StepPath(PathKind.EAGER, max(tokens), tokens)


def eager_reference(seed: int, rank: int, steps: int, records: List[StepRecord], by_path: Optional[dict] = None,
                    device: str = "cpu") -> float:
    """Replays one rank's batches in a single eager process; returns the max |logit diff|
    (and, if `by_path` is given, fills it with the max per path kind)."""
    from sglang.srt.model_executor.graph_dispatch import eager_path
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.test.runner_args import cpu_server_args

    runner = ModelRunner(cpu_server_args(**device_config(device)))
    table = RequestTable(runner)
    by_step = {r.step: r for r in records}
    worst = 0.0
    for step, rows in enumerate(rank_schedule(seed, rank, steps, TINY_DP["max_running_requests"])):
        fb, spec = table.batch(rows)
        if not rows:
            continue
        logits = runner.forward(fb, eager_path(fb)).next_token_logits.float().cpu()
        rec = by_step[step]
        assert rec.rows == spec, f"step {step}: the rank ran a different batch"
        diff = (logits - rec.logits).abs().max().item()
        worst = max(worst, diff)
        if by_path is not None:
            by_path[rec.path] = max(by_path.get(rec.path, 0.0), diff)
    return worst
