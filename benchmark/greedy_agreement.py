"""Greedy agreement between two servers (e.g. BCG and eager): the same seeded prompts, greedy,
fixed length; then the first step where each request's tokens differ.

    python benchmark/greedy_agreement.py collect --port 30000 --num 64 --out bcg.json
    python benchmark/greedy_agreement.py compare bcg.json eager.json

/generate returns no logits, so whether a divergence is a near-tie is not decided here.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random

import aiohttp


async def collect(args) -> None:
    base = f"http://{args.host}:{args.port}"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        async with session.get(f"{base}/get_server_info") as resp:
            vocab = (await resp.json())["vocab_size"]
        rng = random.Random(args.seed)
        prompts = [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(args.num)]

        async def one(ids):
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": args.output_len, "temperature": 0.0,
                                                          "ignore_eos": True}}
            async with session.post(f"{base}/generate", json=body) as resp:
                if resp.status != 200:
                    raise SystemExit(f"HTTP {resp.status}: {await resp.text()}")
                return (await resp.json())["output_ids"]

        outputs = await asyncio.gather(*(one(p) for p in prompts))
    with open(args.out, "w") as f:
        json.dump({"seed": args.seed, "input_len": args.input_len, "outputs": outputs}, f)
    print(f"collected {len(outputs)} greedy outputs of {args.output_len} tokens -> {args.out}")


def compare(a_path: str, b_path: str) -> dict:
    a, b = (json.load(open(p))["outputs"] for p in (a_path, b_path))
    if len(a) != len(b):
        raise SystemExit(f"{a_path} has {len(a)} requests, {b_path} {len(b)}")
    first = []
    for x, y in zip(a, b):
        step = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), None)
        first.append(step if step is not None or len(x) == len(y) else min(len(x), len(y)))
    diverged = [s for s in first if s is not None]
    summary = {"requests": len(a), "identical": len(a) - len(diverged),
               "first_divergence_steps": sorted(diverged)}
    print(json.dumps(summary))
    return summary


def main() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("collect")
    c.add_argument("--host", default="127.0.0.1")
    c.add_argument("--port", type=int, default=30000)
    c.add_argument("--num", type=int, default=64)
    c.add_argument("--input-len", type=int, default=256)
    c.add_argument("--output-len", type=int, default=64)
    c.add_argument("--seed", type=int, default=7)
    c.add_argument("--out", required=True)
    m = sub.add_parser("compare")
    m.add_argument("a")
    m.add_argument("b")
    args = p.parse_args()
    if args.cmd == "collect":
        asyncio.run(collect(args))
    else:
        compare(args.a, args.b)


if __name__ == "__main__":
    main()
