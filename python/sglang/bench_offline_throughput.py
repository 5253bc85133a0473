"""Offline throughput: random token-id prompts, all submitted at once to an in-process Engine.

    python -m sglang.bench_offline_throughput --model-path dsv4-tiny --num-prompts 64 \
        --random-input-len 64 --random-output-len 16 [--enable-mixed-chunk] [any server arg]

Requests go straight to the engine's scheduler (streaming every token) so the first token of
each request is timestamped when the step() that reports it returns. ignore_eos keeps output
lengths exact. With overlap scheduling (the default; --disable-overlap-schedule turns it off)
step() reports the previous forward's tokens after launching the next one, i.e. once the host
has read them: that is when a client could see them, so the timestamps stay right.

A warm-up pass of the same prompt lengths runs first (untimed: Triton JIT compiles for every
batch shape the scheduler produces must not land in a timing), then `--repeats` timed runs of
the whole workload; the result is the median run, with every run and the spread beside it.
Each timed run draws prompts of its own (same lengths, other ids): with prefix caching on (the
default) a repeat of the same prompts would skip their prefill. Each run reports the prompt
tokens it took from the cache (`cached_tokens`, 0 for random prompts).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import random
import time
from typing import Dict, List

from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs
from sglang.srt.server_args_cli import add_cli_args, from_cli_args

_FIRST_TOKEN_ID = 3  # keep prompts clear of bos / eos / pad


@dataclasses.dataclass
class BenchArgs:
    num_prompts: int = 64
    random_input_len: int = 64
    random_output_len: int = 16
    dataset_seed: int = 1
    warmup_prompts: int = 256
    repeats: int = 3
    result_file: str = ""


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=int, default=BenchArgs.num_prompts,
                        help=f"requests of each timed run (default {BenchArgs.num_prompts})")
    parser.add_argument("--random-input-len", type=int, default=BenchArgs.random_input_len,
                        help=f"prompt tokens per request (default {BenchArgs.random_input_len})")
    parser.add_argument("--random-output-len", type=int, default=BenchArgs.random_output_len,
                        help=f"tokens generated per request (default {BenchArgs.random_output_len})")
    parser.add_argument("--dataset-seed", type=int, default=BenchArgs.dataset_seed, help="seed of the prompts")
    parser.add_argument("--warmup-prompts", type=int, default=BenchArgs.warmup_prompts,
                        help="requests of the benchmark's lengths served (untimed) before the runs, "
                             "at most --num-prompts")
    parser.add_argument("--repeats", type=int, default=BenchArgs.repeats,
                        help="timed runs of the whole workload; the median run is reported")
    parser.add_argument("--result-file", type=str, default="", help="append one JSON line with the results")


def random_prompts(n: int, length: int, vocab_size: int, seed) -> List[List[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(_FIRST_TOKEN_ID, vocab_size) for _ in range(length)] for _ in range(n)]


def percentiles(values: List[float]) -> Dict[str, float]:
    if not values:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0}
    s = sorted(values)

    def pct(q: float) -> float:  # linear interpolation between closest ranks
        pos = (len(s) - 1) * q
        lo = int(pos)
        hi = min(lo + 1, len(s) - 1)
        return s[lo] + (s[hi] - s[lo]) * (pos - lo)

    return {"p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99)}


def run_requests(scheduler, prompts: List[List[int]], output_len: int, rid_prefix: str) -> Dict[str, dict]:
    """Submit all prompts at once and step until done; per-request timestamps (seconds)."""
    params = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    recs = {}
    for i, ids in enumerate(prompts):
        rid = f"{rid_prefix}{i}"
        scheduler.add_request(GenerateReqInput(rid=rid, input_ids=ids, sampling_params=params, stream=True))
        recs[rid] = {"submit": t0, "first": None, "end": None, "tokens": 0, "error": None, "cached_tokens": 0}
    pending = set(recs)
    while pending:
        outs = scheduler.step()
        now = time.perf_counter()
        for out in outs:
            rec = recs.get(out.rid)
            if rec is None:
                continue
            if out.new_token_ids and rec["first"] is None:
                rec["first"] = now
            rec["tokens"] = out.completion_tokens
            if out.finished:
                rec["end"], rec["error"], rec["cached_tokens"] = now, out.error, out.cached_tokens
                pending.discard(out.rid)
        if not outs and not scheduler.has_work():
            raise RuntimeError(f"scheduler idle with {len(pending)} unfinished requests")
    return recs


def summarize(recs: Dict[str, dict], input_len: int, elapsed: float) -> dict:
    done = [r for r in recs.values() if r["error"] is None]
    ttft = [(r["first"] - r["submit"]) * 1e3 for r in done if r["first"] is not None]
    tpot = [(r["end"] - r["first"]) * 1e3 / (r["tokens"] - 1) for r in done if r["first"] and r["tokens"] > 1]
    out_tokens = sum(r["tokens"] for r in done)
    return {
        "completed": len(done),
        "failed": len(recs) - len(done),
        "duration_s": elapsed,
        "request_throughput": len(done) / elapsed,
        "input_throughput": len(done) * input_len / elapsed,
        "output_throughput": out_tokens / elapsed,
        "total_output_tokens": out_tokens,
        "ttft_ms": percentiles(ttft),
        "tpot_ms": percentiles(tpot),
    }


def run_benchmark(server_args: ServerArgs, bench_args: BenchArgs) -> dict:
    from sglang.srt.entrypoints.engine import Engine

    overrides = {f.name: getattr(server_args, f.name) for f in dataclasses.fields(server_args)
                 if f.name not in ("model_path", "resolved")}
    engine = Engine(model_path=server_args.model_path, **overrides)
    try:
        sched = engine.scheduler
        dp = engine.model_runner is None  # DP attention: the ranks live in their own processes
        vocab = sched.vocab_size if dp else engine.model_runner.config.vocab_size
        if bench_args.warmup_prompts:
            n_warm = min(bench_args.warmup_prompts, bench_args.num_prompts)
            warm = random_prompts(n_warm, bench_args.random_input_len, vocab, bench_args.dataset_seed + 1)
            run_requests(sched, warm, bench_args.random_output_len, "warmup-")
        runs = []
        for rep in range(max(1, bench_args.repeats)):
            seed = bench_args.dataset_seed if rep == 0 else f"{bench_args.dataset_seed}:{rep}"
            prompts = random_prompts(bench_args.num_prompts, bench_args.random_input_len, vocab, seed)
            before = _stats(sched)
            start = time.perf_counter()
            recs = run_requests(sched, prompts, bench_args.random_output_len, f"bench{rep}-")
            elapsed = time.perf_counter() - start
            after = _stats(sched)
            run = summarize(recs, bench_args.random_input_len, elapsed)
            run["cached_tokens"] = sum(r["cached_tokens"] for r in recs.values())
            # scheduler counters of this run only
            run["forwards"] = {k[len("num_forwards_"):]: after[k] - before[k] for k in after
                               if k.startswith("num_forwards_")}
            for key in ("num_retracted_reqs", "num_overlap_steps", "num_dropped_tokens", "num_forced_resolves"):
                run[key] = after.get(key, 0) - before.get(key, 0)
            if dp:  # share of extend/mixed DP steps (idle-rank steps included) that replayed a breakable graph
                breakable = after.get("dp_breakable_steps", 0) - before.get("dp_breakable_steps", 0)
                ext = after.get("dp_extend_steps", 0) - before.get("dp_extend_steps", 0)
                run["dp_breakable_replayed_fraction"] = breakable / max(1, ext)
            runs.append(run)
        result = dict(sorted(runs, key=lambda r: r["request_throughput"])[len(runs) // 2])
        result["runs"] = [{k: r[k] for k in ("request_throughput", "output_throughput", "duration_s", "ttft_ms",
                                              "tpot_ms", "cached_tokens")} for r in runs]
        tput = [r["request_throughput"] for r in runs]
        result["throughput_spread"] = (max(tput) - min(tput)) / result["request_throughput"]
        result["runner_stats"] = _stats(sched) if dp else engine.model_runner.get_stats()
        result["config"] = {
            **dataclasses.asdict(bench_args),
            **{k: getattr(engine.server_args, k) for k in (
                "model_path", "device", "dtype", "enable_mixed_chunk", "enable_breakable_cuda_graph",
                "chunked_prefill_size", "max_running_requests", "max_total_tokens", "disable_cuda_graph",
                "dp_size", "dp_idle_policy", "disable_overlap_schedule", "enable_prefix_caching")},
        }
        return result
    finally:
        engine.shutdown()


def _stats(sched) -> dict:
    if hasattr(sched, "get_rank_stats"):
        from sglang.srt.managers.dp.stats import aggregate_stats

        return aggregate_stats(sched.get_rank_stats())
    return sched.get_stats()


def format_result(r: dict) -> str:
    lines = [
        f"completed requests:       {r['completed']} ({r['failed']} failed) in {r['duration_s']:.2f} s "
        f"(median of {len(r['runs'])} runs)",
        f"request throughput:       {r['request_throughput']:.2f} req/s (runs: "
        + ", ".join(f"{x['request_throughput']:.2f}" for x in r["runs"]) + f"; spread {r['throughput_spread']:.1%})",
        f"input token throughput:   {r['input_throughput']:.1f} tok/s",
        f"output token throughput:  {r['output_throughput']:.1f} tok/s",
        "TTFT ms p50/p90/p99:      {p50:.1f} / {p90:.1f} / {p99:.1f}".format(**r["ttft_ms"]),
        "TPOT ms p50/p90/p99:      {p50:.2f} / {p90:.2f} / {p99:.2f}".format(**r["tpot_ms"]),
        "forwards by mode:         " + ", ".join(f"{k}={v}" for k, v in r["forwards"].items()),
        f"retracted requests:       {r['num_retracted_reqs']}",
        f"prefix cache:             {'on' if r['config']['enable_prefix_caching'] else 'off'} "
        f"({r['cached_tokens']} prompt tokens taken from it)",
        f"overlap scheduling:       {'off' if r['config']['disable_overlap_schedule'] else 'on'} "
        f"({r['num_overlap_steps']} forwards launched before the previous one was read, "
        f"{r['num_dropped_tokens']} tokens dropped after a stop, {r['num_forced_resolves']} forced resolves)",
        f"runner stats:             {json.dumps(r['runner_stats'])}",
    ]
    if "dp_breakable_replayed_fraction" in r:
        lines.append(f"DP extend/mixed steps replayed from breakable graphs: {r['dp_breakable_replayed_fraction']:.1%}")
    return "\n".join(lines)


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m sglang.bench_offline_throughput",
                                     description=__doc__.splitlines()[0])
    add_cli_args(parser)
    add_bench_args(parser)
    return parser


def main(argv=None) -> dict:
    args = make_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper())
    server_args = from_cli_args(args)
    bench_args = BenchArgs(**{f.name: getattr(args, f.name) for f in dataclasses.fields(BenchArgs)})
    result = run_benchmark(server_args, bench_args)
    print(format_result(result))
    if bench_args.result_file:
        with open(bench_args.result_file, "a") as f:
            f.write(json.dumps(result) + "\n")
    return result


if __name__ == "__main__":
    main()
