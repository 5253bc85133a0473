"""What bench_one_batch times, shared by its one-process run and its DP ranks
(bench_one_batch_dp.py): the batches (`make_batch`), timing, the ideal graph, the physical
limit, the runner's settings for the flags (`server_args_for`), `Steps` (how a world of one
runs each step) and `run_bench` (the rows and the table). The command line: bench_one_batch.py.
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from typing import Optional

import torch

from sglang.srt.configs.loader import load_model_config
from sglang.srt.model_executor.breakable_cuda_graph import break_ops_inline, create_breakable_graph
from sglang.srt.model_executor.forward_batch_info import ForwardMode, build_forward_batch
from sglang.srt.model_executor.forward_context import forward_context
from sglang.srt.model_executor.graph_dispatch import PathKind, decide_step_path, describe, eager_path
from sglang.srt.planning import step_cost
from sglang.srt.server_args import ServerArgs


def make_batch(runner, mode: str, n: int, prefix: int, max_chunk: int, n_decode: int, seed: int = 0):
    """Extend: prefill chunks of <= max_chunk tokens on top of `prefix` cached tokens.
    Mixed: one prefill chunk plus `n_decode` decode rows (all with `prefix` cached tokens).
    Decode: n requests of one new token each. `seed` draws the token ids (a DP rank's own)."""
    rtp = runner.req_to_token_pool
    rows = []
    if mode == "decode":
        rows = [1] * n
    elif mode == "mixed":
        rows.append(n - n_decode)
        rows += [1] * n_decode
    else:
        while n > 0:
            rows.append(min(n, max_chunk))
            n -= rows[-1]
    slots = [rtp.alloc_req() for _ in rows]
    for s, r in zip(slots, rows):
        rtp.ensure_capacity(s, prefix + r)
    gen = torch.Generator().manual_seed(seed)
    toks = [torch.randint(3, runner.config.vocab_size, (r,), generator=gen).tolist() for r in rows]
    fb_mode = {"mixed": ForwardMode.MIXED, "decode": ForwardMode.DECODE}.get(mode, ForwardMode.EXTEND)
    fb = build_forward_batch(fb_mode, slots, [prefix] * len(rows), toks, runner.device)
    return fb, slots


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, iters: int, repeats: int, warmup: int) -> list:
    """ms per step of each of `repeats` runs of `iters` steps, after `warmup` untimed steps."""
    for _ in range(warmup):
        fn()
    _sync(device)
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        _sync(device)
        runs.append((time.perf_counter() - start) / iters * 1e3)
    return runs


def top_kernels(fn, device, top: int) -> dict:
    """The kernels of one `fn()` step under torch.profiler: on CUDA the GPU kernels (and copies)
    by their own device time, on CPU the ops by their own CPU time. Returns the `top` largest
    (name, calls, ms, share of the total) with the step's kernel count and total ms."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    fn()  # warm: first-call compiles and allocations stay out of the profile
    _sync(device)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        fn()
        _sync(device)
    own_us = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    # On CUDA only the device's own events: an op's self device time repeats its kernels'. In
    # launch order (the result file keeps them): a layer's kernel list is one period of it.
    events = sorted((e for e in prof.events()
                     if not (cuda and e.device_type == torch.autograd.DeviceType.CPU) and own_us(e) > 0),
                    key=lambda e: e.time_range.start)
    sequence = [(e.name, round(own_us(e), 2)) for e in events]
    calls, ms = collections.Counter(), collections.defaultdict(float)
    for e in events:
        calls[e.name] += 1
        ms[e.name] += own_us(e) / 1e3
    rows = sorted(((name, calls[name], ms[name]) for name in calls), key=lambda r: -r[2])
    total = sum(r[2] for r in rows)
    return dict(kind="GPU kernels" if cuda else "CPU ops", num_kernels=sum(r[1] for r in rows), total_ms=total,
                top=[dict(name=n, calls=c, ms=ms, share=ms / total if total else 0.0) for n, c, ms in rows[:top]],
                sequence_us=sequence)


def print_top_kernels(label: str, prof: dict) -> None:
    print(f"  {label}: {prof['num_kernels']} {prof['kind']}, {prof['total_ms']:.3f} ms in them")
    for k in prof["top"]:
        print(f"    {k['ms']:9.3f} ms {k['share']:6.1%} {k['calls']:5d}x  {k['name'][:90]}")


def median(xs: list) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2


def spread(xs: list) -> float:
    """(max - min) / median of the runs: the run-to-run noise of one figure."""
    return (max(xs) - min(xs)) / median(xs)


def ideal_graph(runner, fb, dp_moe=None):
    """One unbroken graph for exactly this batch (static metadata captured in).
    Returns (graph, replay); replay re-enters the forward context for the CPU emulator,
    which re-runs the inline attention op in Python (a CUDA graph runs no Python).
    Under DP (`dp_moe`, every rank capturing at once) the MoE collectives are in the graph."""
    backend = runner.attn_backend
    metadata = backend.init_forward_metadata_for_breakable_cuda_graph_capture(fb)
    with torch.inference_mode(), forward_context(fb, backend, fb.num_tokens, dp_moe), break_ops_inline():
        runner.model(fb.input_ids)
        graph = create_breakable_graph(runner.device)
        with graph.capture():
            runner.model(fb.input_ids)

    def replay():
        backend.forward_metadata = metadata
        with forward_context(fb, backend, fb.num_tokens, dp_moe):
            graph.replay()

    return graph, replay


def limit_ms(config, mode: str, n: int, prefix: int, kv_pool, ep_size: int = 1,
             ceilings: Optional[step_cost.Ceilings] = step_cost.H200) -> Optional[float]:
    """The step's physical bound on one GPU with `ceilings`' peaks, in ms (None for a GPU whose
    peaks are not known): the larger of its HBM time (the weights its n tokens touch and the KV
    they read at `prefix` context, in `kv_pool`'s row and indexer-key formats) and, for extend /
    mixed, its FLOP time (see the module docstring). `ep_size`: under DP each rank holds
    1/ep_size of the routed experts and its MoE sees every rank's n tokens."""
    if ceilings is None:
        return None
    row = kv_pool.fp8_layout.row_bytes if kv_pool.fp8_layout is not None else None
    key = kv_pool.index_key_layout.row_bytes if kv_pool.index_key_layout is not None else None
    hbm = step_cost.decode_step_cost(config, n, prefix, ep_size=ep_size, kv_row_bytes=row,
                                     index_key_bytes=key).seconds(ceilings)
    if mode == "decode":
        return hbm * 1e3
    peak = ceilings.peak_flops(config.fp8_linears)
    return max(hbm, n * step_cost.flops_per_token(config, prefix) / peak) * 1e3


def device_ceilings(dev: torch.device) -> Optional[step_cost.Ceilings]:
    """The peaks a step on `dev` is judged against: its own GPU's; on CPU an H200's, on paper
    (what the model would be bound by on the GPU it is built for)."""
    if dev.type != "cuda":
        return step_cost.H200
    return step_cost.ceilings_for(torch.cuda.get_device_name(dev))


def print_capture_table(breakable) -> None:
    """Graph pool growth and capture seconds of each bucket, in capture order (largest first:
    the first allocates the pool, the later ones mostly reuse it)."""
    print(f"{'bucket':>6} {'pool MiB':>9} {'capture s':>9}")
    for bucket, nbytes in breakable.graph_memory_by_bucket.items():
        print(f"{bucket:6d} {nbytes / 2**20:9.1f} {breakable.capture_seconds_by_bucket[bucket]:9.2f}")
    print(f"{'total':>6} {breakable.graph_memory_bytes / 2**20:9.1f} {breakable.capture_seconds:9.2f}  "
          f"(device memory taken by the capture: {breakable.capture_memory_bytes / 2**20:.1f} MiB)")


def server_args_for(a: argparse.Namespace, dp_size: int = 1) -> ServerArgs:
    """The runner's resolved settings for these benchmark flags (under DP: one rank's, built
    after the rank selected its GPU and joined the DP groups)."""
    max_tokens = max(a.num_tokens)
    n_reqs = 2 * (max_tokens // a.max_chunk + a.decode_rows + 2)
    decode = "decode" in a.modes
    if decode:  # a decode batch is one request per row
        n_reqs = max(n_reqs, max_tokens + 2)
    # a smaller model than --context-length allows runs at its own limit
    max_positions = load_model_config(a.model_path, a.num_layers).max_position_embeddings
    return ServerArgs(
        model_path=a.model_path, load_format=a.load_format, num_layers=a.num_layers, device=a.device,
        dtype=a.dtype or "auto", context_length=min(a.context_length, max_positions),
        max_running_requests=n_reqs, max_total_tokens=n_reqs * (a.prefix + a.max_chunk + 128),
        enable_breakable_cuda_graph=True, breakable_cuda_graph_tokens=sorted(set(a.num_tokens)),
        breakable_cuda_graph_max_tokens=max_tokens, disable_cuda_graph=not decode,
        cuda_graph_max_bs=max_tokens if decode else None, attention_backend=a.attention_backend,
        # only the batch sizes timed: fewer captures, and no compiles for batch tiers no row uses
        cuda_graph_bs=sorted(set(a.num_tokens)) if decode else None,
        segment_kernels=a.segment_kernels, quant_numerics=a.quant_numerics, kv_cache_dtype=a.kv_cache_dtype,
        moe_backend=a.moe_backend, enable_dp_attention=dp_size > 1, dp_size=dp_size,
    ).resolve(cuda_available=torch.cuda.is_available())


class Steps:
    """How this process runs the benchmark's steps: a world of one (the runner decides its own
    path). The DP twin, `bench_one_batch_dp.DPSteps`, runs every step through `dp_step`."""

    rank, dp_size = 0, 1

    def __init__(self, runner):
        self.runner = runner

    def eager(self, fb):
        path = eager_path(fb)
        return lambda: self.runner.forward(fb, path)

    def graph(self, fb, want: PathKind):
        path = decide_step_path((describe(fb),), self.runner.graph_tables)
        if path.kind != want:
            raise RuntimeError(f"the batch takes path {path.kind.name} ({path.reason}), not {want.name}")
        return lambda: self.runner.forward(fb, path)

    def ideal(self, fb):
        return ideal_graph(self.runner, fb)

    def comm_ms(self, fb) -> Optional[float]:
        return None  # no collectives in a world of one

    def comm_transfer_ms(self, fb, iters: int, repeats: int, warmup: int) -> Optional[float]:
        return None

    def gather(self, value) -> list:
        """Every rank's `value`, in rank order (a collective under DP)."""
        return [value]


def _fmt(x: Optional[float], spec: str, width: int) -> str:
    return f"{x:{width}{spec}}" if x is not None else f"{'-':>{width}}"


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def run_bench(a: argparse.Namespace, runner, steps: Steps) -> dict:
    """Every (mode, tokens) row timed eager / graph / ideal on `steps`; rank 0 prints the table.
    Returns the result (what --result-file holds)."""
    breakable = runner.breakable_runner
    dev = runner.device
    dp = steps.dp_size > 1
    say = print if steps.rank == 0 else (lambda *_, **__: None)
    rows = []
    ceilings = device_ceilings(dev)
    header = (f"{'mode':6} {'tokens':>6} {'eager ms':>9} {'bcg ms':>8} {'ideal ms':>9} {'eager/bcg':>9} "
              f"{'bcg/ideal':>9} {'breaks':>6} {'spread e/b/i':>17} {'limit ms':>9} {'% limit':>7}")
    if dp:
        header += f" {'comm ms':>8} {'comm %':>6} {'xfer ms':>8} {'xfer %':>6}"
    say(f"model {a.model_path} on {dev} ({runner.server_args.dtype}); BCG capture {breakable.capture_seconds:.1f}s for "
        f"{len(breakable.buckets)} buckets, graph memory {breakable.graph_memory_bytes / 2**20:.0f} MiB"
        + (f"; DP attention {steps.dp_size} ranks, experts split {steps.dp_size} ways (rank 0 shown)" if dp else ""))
    if steps.rank == 0:
        print_capture_table(breakable)
    say(f"limit: {ceilings.name} peaks, HBM {ceilings.hbm_bytes_per_s / 1e12:.2f} TB/s, "
        f"{ceilings.peak_flops(runner.config.fp8_linears) / 1e12:.0f} TFLOP/s"
        + (" (on paper: no GPU here)" if dev.type != "cuda" else "") if ceilings is not None
        else f"limit: '-' (no peaks known for {torch.cuda.get_device_name(dev)})")
    say(header)
    for mode in a.modes:
        want = PathKind.DECODE_GRAPH if mode == "decode" else PathKind.BREAKABLE
        graphs = runner.graph_runners[want]
        for n in a.num_tokens:
            n_dec = min(a.decode_rows, n // 2) if mode == "mixed" else 0
            fb, slots = make_batch(runner, mode, n, a.prefix, a.max_chunk, n_dec, seed=steps.rank)
            t = dict(iters=a.iters, repeats=a.repeats, warmup=a.warmup)
            with torch.inference_mode():
                eager_runs = timed(steps.eager(fb), dev, **t)
                comm = steps.comm_ms(fb)
                xfer = steps.comm_transfer_ms(fb, **t)
                replays_before = graphs.num_replays
                breakable_runs = timed(steps.graph(fb, want), dev, **t)
                replays = graphs.num_replays - replays_before
                if mode == "decode":  # the decode graph is the whole step already
                    ideal_runs = breakable_runs
                elif a.skip_ideal:
                    ideal_runs = None
                else:
                    graph, replay_ideal = steps.ideal(fb)
                    ideal_runs = timed(replay_ideal, dev, **t)
                    graph.release()
            eager, replay = median(eager_runs), median(breakable_runs)
            ideal = median(ideal_runs) if ideal_runs else None
            breaks = 0 if mode == "decode" else breakable.graphs[breakable.bucket_for(n)].num_breaks
            bound = limit_ms(runner.config, mode, n, a.prefix, runner.kv_pool, steps.dp_size, ceilings)
            per_rank = steps.gather(dict(graph_replays=replays, comm_ms=comm, comm_transfer_ms=xfer))
            row = dict(mode=mode, tokens=n, eager_ms=eager, bcg_ms=replay, ideal_ms=ideal,
                       eager_over_bcg=eager / replay, bcg_over_ideal=_ratio(replay, ideal), breaks=breaks,
                       limit_ms=bound, ideal_over_limit=_ratio(ideal, bound),
                       eager_runs_ms=eager_runs, bcg_runs_ms=breakable_runs, ideal_runs_ms=ideal_runs,
                       graph_replays_by_rank=[r["graph_replays"] for r in per_rank])
            if dp:
                row.update(comm_ms=comm, comm_share=comm / eager, comm_ms_by_rank=[r["comm_ms"] for r in per_rank],
                           comm_transfer_ms=xfer, comm_transfer_share=xfer / eager,
                           comm_transfer_ms_by_rank=[r["comm_transfer_ms"] for r in per_rank])
            rows.append(row)
            noise = "/".join(f"{spread(r):.0%}" if r else "-" for r in (eager_runs, breakable_runs, ideal_runs))
            line = (f"{mode:6} {n:6d} {eager:9.2f} {replay:8.2f} {_fmt(ideal, '.2f', 9)} {eager / replay:9.2f} "
                    f"{_fmt(_ratio(replay, ideal), '.2f', 9)} {breaks:6d} {noise:>17} {_fmt(bound, '.3g', 9)} "
                    f"{_fmt(_ratio(bound, ideal), '.1%', 7)}")
            if dp:
                line += f" {comm:8.2f} {comm / eager:6.0%} {xfer:8.2f} {xfer / eager:6.0%}"
            say(line, flush=True)
            if a.profile_kernels:
                with torch.inference_mode():  # every rank: an eager DP step is a collective
                    row["kernels"] = top_kernels(steps.eager(fb), dev, a.profile_kernels)
                    if mode == "decode":  # the graph's own kernels (its configs can differ from eager's)
                        row["graph_kernels"] = top_kernels(steps.graph(fb, want), dev, a.profile_kernels)
                if steps.rank == 0:
                    print_top_kernels(f"{mode} {n}, one eager step", row["kernels"])
                    if "graph_kernels" in row:
                        print_top_kernels(f"{mode} {n}, one graph replay", row["graph_kernels"])
            for s in slots:
                runner.req_to_token_pool.free_req(s)
    result = dict(model=a.model_path, device=str(dev),
                  device_name=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                  limit_peaks=ceilings.name if ceilings is not None else None, dtype=runner.server_args.dtype,
                  dp_size=steps.dp_size, rows=rows,
                  capture_seconds=breakable.capture_seconds, graph_memory_bytes=breakable.graph_memory_bytes,
                  capture_memory_bytes=breakable.capture_memory_bytes,
                  graph_memory_by_bucket=breakable.graph_memory_by_bucket,
                  capture_seconds_by_bucket=breakable.capture_seconds_by_bucket)
    if a.result_file and steps.rank == 0:
        with open(a.result_file, "w") as f:
            json.dump(result, f, indent=1)
    return result
