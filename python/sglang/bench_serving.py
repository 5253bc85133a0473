"""`python -m sglang.bench_serving`: load a running server's /generate with random token-id
prompts (streaming, ignore_eos) at bounded concurrency; report request and token throughput,
TTFT, TPOT and ITL percentiles.

    python -m sglang.bench_serving --base-url http://127.0.0.1:30000 --num-prompts 64 \\
        --random-input-len 64 --random-output-len 16 --max-concurrency 16
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


async def run(args) -> dict:
    base = args.base_url or f"http://{args.host}:{args.port}"
    timeout = aiohttp.ClientTimeout(total=None, sock_read=args.request_timeout)
    connector = aiohttp.TCPConnector(limit=0)  # the semaphore bounds concurrency, not the pool
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        async with session.get(f"{base}/get_server_info") as resp:
            resp.raise_for_status()
            info = await resp.json()
        prompts = make_prompts(args, info["vocab_size"])
        url = f"{base}/generate"
        ignore_eos = not args.disable_ignore_eos
        for ids, out_len in prompts[: args.warmup_requests]:
            warm = await send_request(session, url, ids, min(out_len, 4), ignore_eos)
            if not warm.success:
                raise SystemExit(f"warm-up request failed: {warm.error}")
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
    p.add_argument("--num-prompts", type=int, default=64, help="requests of the timed run (default 64)")
    p.add_argument("--random-input-len", type=int, default=512, help="prompt tokens per request (default 512)")
    p.add_argument("--random-output-len", type=int, default=128,
                   help="tokens generated per request (default 128)")
    p.add_argument("--random-range-ratio", type=float, default=1.0,
                   help="lengths are uniform in [ratio * len, len]; 1.0 = fixed lengths")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at once (default: all)")
    p.add_argument("--warmup-requests", type=int, default=1,
                   help="requests sent one by one before the timed run, of at most 4 output tokens (default 1)")
    p.add_argument("--disable-ignore-eos", action="store_true",
                   help="let requests stop at EOS (by default they generate exactly their output length)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds without a streamed byte")
    p.add_argument("--seed", type=int, default=1, help="seed of the prompts' token ids and lengths (default 1)")
    p.add_argument("--output-file", default=None, help="append the result as one JSON line")
    p.add_argument("--tag", default=None, help="a label stored in that line (e.g. which server: bcg / eager)")
    return p


def main(argv=None) -> None:
    args = make_parser().parse_args(argv)
    metrics = asyncio.run(run(args))
    print_summary(metrics, args)
    if args.output_file:
        with open(args.output_file, "a") as f:
            f.write(json.dumps({"args": vars(args), **metrics}) + "\n")


if __name__ == "__main__":
    main()
