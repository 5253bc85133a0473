"""`python -m sglang.bench_serving`: load a running server's /generate with token-id prompts
(streaming, ignore_eos) at bounded concurrency; report request and token throughput, TTFT, TPOT
and ITL percentiles.

Two workloads (`--dataset-name`): random (independent random prompts) and multi-turn (chat
sessions sharing a system prompt, each turn's prompt the whole conversation so far: per turn
index, TTFT, throughput and the server's cached_tokens against what an ideal cache would hold).

    python -m sglang.bench_serving --base-url http://127.0.0.1:30000 --num-prompts 64 \\
        --random-input-len 64 --random-output-len 16 --max-concurrency 16
    python -m sglang.bench_serving --dataset-name multi-turn --num-sessions 16 --num-turns 4 \\
        --system-prompt-len 1024 --turn-input-len 1024 --turn-output-len 128 --max-concurrency 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field

import aiohttp
import numpy as np

# Prompt ids avoid the first ids (BOS/EOS/PAD in the DSV4 layouts) and a real vocabulary's
# top, where the special tokens live.
MIN_PROMPT_ID = 3
MAX_PROMPT_ID = 100_000


@dataclass
class RequestResult:
    prompt_len: int
    success: bool = False
    output_len: int = 0
    ttft: float = 0.0  # seconds to the first streamed token
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between streamed chunks
    error: str = ""
    output_ids: list[int] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens the server took from its prefix cache


def make_prompts(args, vocab_size: int) -> list[tuple[list[int], int]]:
    rng = random.Random(args.seed)
    hi = min(vocab_size, MAX_PROMPT_ID)

    def length(n: int) -> int:
        return rng.randint(max(1, int(n * args.random_range_ratio)), n)

    prompts = []
    for _ in range(args.num_prompts):
        ids = [rng.randrange(MIN_PROMPT_ID, hi) for _ in range(length(args.random_input_len))]
        prompts.append((ids, length(args.random_output_len)))
    return prompts


async def send_request(session, url: str, input_ids: list[int], output_len: int, ignore_eos: bool) -> RequestResult:
    body = {
        "input_ids": input_ids,
        "sampling_params": {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": ignore_eos},
        "stream": True,
    }
    result = RequestResult(prompt_len=len(input_ids))
    start = last = time.perf_counter()
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {await resp.text()}"
                return result
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data:") :])
                if "error" in chunk:
                    result.error = chunk["error"].get("message", str(chunk))
                    return result
                now = time.perf_counter()
                if not chunk["output_ids"]:
                    continue
                if result.ttft == 0.0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
                result.output_len = chunk["meta_info"]["completion_tokens"]
                result.output_ids = chunk["output_ids"]  # every event carries all ids so far
                result.cached_tokens = chunk["meta_info"].get("cached_tokens", 0)
        result.latency = time.perf_counter() - start
        result.success = True
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


def _stats_ms(values: list[float]) -> dict:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    a = np.asarray(values) * 1000
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)),
            "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99))}


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.success]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_len for r in ok)
    # TPOT: time per output token after the first, per request.
    tpot = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "input_throughput": input_tokens / duration,
        "output_throughput": output_tokens / duration,
        "total_throughput": (input_tokens + output_tokens) / duration,
        "ttft_ms": _stats_ms([r.ttft for r in ok]),
        "tpot_ms": _stats_ms(tpot),
        "itl_ms": _stats_ms([x for r in ok for x in r.itl]),
        "e2e_latency_ms": _stats_ms([r.latency for r in ok]),
    }


def print_summary(m: dict, args) -> None:
    print(f"{' Serving Benchmark Result ':=^60}")
    rows = [
        ("Max concurrency", args.max_concurrency or "unbounded"),
        ("Successful requests", m["completed"]),
        ("Failed requests", m["failed"]),
        ("Benchmark duration (s)", f"{m['duration_s']:.2f}"),
        ("Total input tokens", m["total_input_tokens"]),
        ("Total generated tokens", m["total_output_tokens"]),
        ("Request throughput (req/s)", f"{m['request_throughput']:.2f}"),
        ("Input token throughput (tok/s)", f"{m['input_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{m['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{m['total_throughput']:.2f}"),
    ]
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_latency_ms"):
        label = name[: -len("_ms")].upper().replace("E2E_LATENCY", "E2E latency")
        for stat in ("mean", "p50", "p90", "p99"):
            rows.append((f"{stat.capitalize()} {label} (ms)", f"{m[name][stat]:.2f}"))
    for name, value in rows:
        print(f"{name:<40}{value:>20}")
    print("=" * 60)


# ---- multi-turn chat -------------------------------------------------------------------


@dataclass
class Turn:
    """One request of a multi-turn session: its prompt, result and when it was sent (seconds
    from the start of the timed run)."""

    session: int
    index: int
    prompt: list[int]
    result: RequestResult
    sent_at: float
    shareable: int = 0  # filled in after the run (`shareable_tokens`)

    @property
    def done_at(self) -> float:
        return self.sent_at + self.result.latency


def make_sessions(args, vocab_size: int) -> tuple[list[int], list[list[list[int]]]]:
    """(the system prompt every session starts with, each session's user messages); seeded
    apart from the random dataset's prompts, which warm the server up."""
    rng = random.Random(f"multi-turn:{args.seed}")
    hi = min(vocab_size, MAX_PROMPT_ID)

    def message(n: int) -> list[int]:
        return [rng.randrange(MIN_PROMPT_ID, hi) for _ in range(n)]

    system = message(args.system_prompt_len)
    users = [[message(args.turn_input_len) for _ in range(args.num_turns)] for _ in range(args.num_sessions)]
    return system, users


def longest_prompt(args) -> int:
    """The last turn's prompt: system prompt, every user message, every earlier answer."""
    return args.system_prompt_len + args.num_turns * args.turn_input_len + (args.num_turns - 1) * args.turn_output_len


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


def shareable_tokens(turns: list[Turn]) -> None:
    """Set each turn's `shareable`: the prompt tokens an ideal cache (unbounded, one for the
    whole server, sharing even a prefill still in flight) could serve when the turn is sent: the
    longest prefix its prompt shares with an earlier request's prompt, or with a finished
    request's prompt and answer (all but the answer's last token, which was sampled, never
    computed). At most the prompt's length - 1: the last prompt token must be computed to
    sample the first answer token. A server caches no more than this (it keeps what it
    computed, generated tokens only on finish), so cached / shareable is at most 1 unless the
    server kept prompts from before the run."""
    computed = []  # (since when, token ids)
    for t in turns:
        computed.append((t.sent_at, np.asarray(t.prompt)))
        if t.result.success:
            computed.append((t.done_at, np.asarray(t.prompt + t.result.output_ids[:-1])))
    for t in turns:
        prompt = np.asarray(t.prompt)
        best = max((_common_prefix(prompt, seq) for since, seq in computed if since < t.sent_at), default=0)
        t.shareable = min(best, len(t.prompt) - 1)


def summarize_turns(turns: list[Turn], num_turns: int) -> list[dict]:
    """One row per turn index. Throughput is that index's tokens over its span (first send to
    last finish); spans of different indices overlap when sessions interleave."""
    rows = []
    for i in range(num_turns):
        ts = [t for t in turns if t.index == i]
        ok = [t for t in ts if t.result.success]
        if not ts:
            continue
        span = max((t.done_at for t in ok), default=0.0) - min(t.sent_at for t in ts)
        prompt = sum(len(t.prompt) for t in ok)
        output = sum(t.result.output_len for t in ok)
        cached = sum(t.result.cached_tokens for t in ok)
        shareable = sum(t.shareable for t in ok)
        tpot = [(t.result.latency - t.result.ttft) / (t.result.output_len - 1) for t in ok if t.result.output_len > 1]
        rows.append({
            "turn": i,
            "completed": len(ok),
            "failed": len(ts) - len(ok),
            "mean_prompt_tokens": prompt / max(len(ok), 1),
            "ttft_ms": _stats_ms([t.result.ttft for t in ok]),
            "tpot_ms": _stats_ms(tpot),
            "e2e_latency_ms": _stats_ms([t.result.latency for t in ok]),
            "span_s": span,
            "input_throughput": prompt / span if span > 0 else 0.0,
            "output_throughput": output / span if span > 0 else 0.0,
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "shareable_tokens": shareable,
            "hit_rate": cached / shareable if shareable else 0.0,  # of what an ideal cache would hold
            "cached_fraction": cached / prompt if prompt else 0.0,  # of all prompt tokens
        })
    return rows


async def run_multi_turn(args, session, url: str, vocab_size: int, ignore_eos: bool) -> dict:
    """N sessions, each sending its turns one after another (a turn's prompt: the whole
    conversation so far, the answer included, then the next user message); at most
    --max-concurrency requests in flight over all sessions, so sessions interleave."""
    system, users = make_sessions(args, vocab_size)
    sem = asyncio.Semaphore(args.max_concurrency or args.num_sessions)
    turns: list[Turn] = []
    start = time.perf_counter()

    async def converse(s: int) -> None:
        history = list(system)
        for i in range(args.num_turns):
            prompt = history + users[s][i]
            async with sem:
                sent_at = time.perf_counter() - start
                result = await send_request(session, url, prompt, args.turn_output_len, ignore_eos)
            turns.append(Turn(s, i, prompt, result, sent_at))
            if not result.success:
                return  # the rest of this conversation cannot be built
            history = prompt + result.output_ids

    await asyncio.gather(*(converse(s) for s in range(args.num_sessions)))
    duration = time.perf_counter() - start
    for t in turns:
        if not t.result.success:
            print(f"request failed (session {t.session}, turn {t.index}): {t.result.error}")
            break
    shareable_tokens(turns)
    metrics = summarize([t.result for t in turns], duration)
    metrics["dataset"] = "multi-turn"
    metrics["turns"] = summarize_turns(turns, args.num_turns)
    cached = sum(r["cached_tokens"] for r in metrics["turns"])
    shareable = sum(r["shareable_tokens"] for r in metrics["turns"])
    metrics["total_cached_tokens"] = cached
    metrics["total_shareable_tokens"] = shareable
    metrics["hit_rate"] = cached / shareable if shareable else 0.0
    return metrics


def print_turns(m: dict) -> None:
    print(f"{' Per turn ':=^112}")
    print(f"{'turn':>4} {'reqs':>5} {'prompt':>7} {'TTFT mean':>10} {'p50':>8} {'p99':>8} {'in tok/s':>10} "
          f"{'out tok/s':>10} {'cached':>9} {'shareable':>10} {'hit rate':>9} {'cached/prompt':>14}")
    for r in m["turns"]:
        t = r["ttft_ms"]
        print(f"{r['turn']:>4} {r['completed']:>5} {r['mean_prompt_tokens']:>7.0f} {t['mean']:>10.1f} {t['p50']:>8.1f} "
              f"{t['p99']:>8.1f} {r['input_throughput']:>10.1f} {r['output_throughput']:>10.1f} "
              f"{r['cached_tokens']:>9} {r['shareable_tokens']:>10} {r['hit_rate']:>9.1%} {r['cached_fraction']:>14.1%}")
    print(f"all turns: {m['total_cached_tokens']} cached of {m['total_shareable_tokens']} shareable prompt tokens "
          f"(hit rate {m['hit_rate']:.1%})")
    print("=" * 112)


async def run(args) -> dict:
    base = args.base_url or f"http://{args.host}:{args.port}"
    timeout = aiohttp.ClientTimeout(total=None, sock_read=args.request_timeout)
    connector = aiohttp.TCPConnector(limit=0)  # the semaphore bounds concurrency, not the pool
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        async with session.get(f"{base}/get_server_info") as resp:
            resp.raise_for_status()
            info = await resp.json()
        multi_turn = args.dataset_name == "multi-turn"
        if multi_turn and longest_prompt(args) + args.turn_output_len > info["context_length"]:
            raise SystemExit(f"the last turn needs {longest_prompt(args) + args.turn_output_len} tokens, above the "
                             f"server's context length {info['context_length']}: fewer or shorter turns, or a server "
                             f"with a larger --context-length")
        prompts = make_prompts(args, info["vocab_size"])
        url = f"{base}/generate"
        ignore_eos = not args.disable_ignore_eos
        # warm-up prompts are random (seeded apart from the sessions'): they share nothing
        for ids, out_len in prompts[: args.warmup_requests]:
            warm = await send_request(session, url, ids, min(out_len, 4), ignore_eos)
            if not warm.success:
                raise SystemExit(f"warm-up request failed: {warm.error}")
        if multi_turn:
            return await run_multi_turn(args, session, url, info["vocab_size"], ignore_eos)
        sem = asyncio.Semaphore(args.max_concurrency or len(prompts))

        async def bounded(ids, out_len):
            async with sem:
                return await send_request(session, url, ids, out_len, ignore_eos)

        start = time.perf_counter()
        results = await asyncio.gather(*(bounded(ids, n) for ids, n in prompts))
        duration = time.perf_counter() - start
    for r in results:
        if not r.success:
            print(f"request failed: {r.error}")
            break
    return summarize(results, duration)


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sglang.bench_serving", description=__doc__.splitlines()[0])
    p.add_argument("--base-url", default=None, help="e.g. http://127.0.0.1:30000 (overrides --host/--port)")
    p.add_argument("--host", default="127.0.0.1", help="server host, when no --base-url (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=30000, help="server port, when no --base-url (default 30000)")
    p.add_argument("--dataset-name", choices=("random", "multi-turn"), default="random",
                   help="random: --num-prompts independent random prompts; multi-turn: --num-sessions chat "
                        "sessions of --num-turns turns over a shared system prompt (default random)")
    p.add_argument("--num-prompts", type=int, default=64, help="requests of the timed run (default 64)")
    p.add_argument("--random-input-len", type=int, default=512, help="prompt tokens per request (default 512)")
    p.add_argument("--random-output-len", type=int, default=128,
                   help="tokens generated per request (default 128)")
    p.add_argument("--random-range-ratio", type=float, default=1.0,
                   help="lengths are uniform in [ratio * len, len]; 1.0 = fixed lengths")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="requests in flight at once (default: all; multi-turn: one per session)")
    p.add_argument("--num-sessions", type=int, default=16, help="multi-turn: chat sessions (default 16)")
    p.add_argument("--num-turns", type=int, default=4, help="multi-turn: user turns per session (default 4)")
    p.add_argument("--system-prompt-len", type=int, default=1024,
                   help="multi-turn: tokens of the system prompt every session starts with (default 1024)")
    p.add_argument("--turn-input-len", type=int, default=1024,
                   help="multi-turn: tokens of each user message (default 1024)")
    p.add_argument("--turn-output-len", type=int, default=128,
                   help="multi-turn: tokens of each answer, appended to the conversation (default 128)")
    p.add_argument("--warmup-requests", type=int, default=1,
                   help="requests sent one by one before the timed run, of at most 4 output tokens (default 1)")
    p.add_argument("--disable-ignore-eos", action="store_true",
                   help="let requests stop at EOS (by default they generate exactly their output length)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds without a streamed byte")
    p.add_argument("--seed", type=int, default=1, help="seed of the prompts' token ids and lengths (default 1)")
    p.add_argument("--output-file", default=None, help="append the result as one JSON line")
    p.add_argument("--tag", default=None, help="a label stored in that line (e.g. which server: bcg / eager)")
    return p


def check_args(p: argparse.ArgumentParser, args) -> None:
    positive = ["num_prompts", "random_input_len", "random_output_len", "num_sessions", "num_turns",
                "turn_input_len", "turn_output_len", "max_concurrency"]
    for name in positive:
        v = getattr(args, name)
        if v is not None and v < 1:
            p.error(f"--{name.replace('_', '-')} must be positive, got {v}")
    if args.system_prompt_len < 0:
        p.error(f"--system-prompt-len must be >= 0, got {args.system_prompt_len}")


def main(argv=None) -> None:
    parser = make_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    metrics = asyncio.run(run(args))
    print_summary(metrics, args)
    if "turns" in metrics:
        print_turns(metrics)
    if args.output_file:
        with open(args.output_file, "a") as f:
            f.write(json.dumps({"args": vars(args), **metrics}) + "\n")


if __name__ == "__main__":
    main()
