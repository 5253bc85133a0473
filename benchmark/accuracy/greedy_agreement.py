"""Greedy agreement between two servers (e.g. BCG and eager): the same seeded prompts, greedy,
fixed length; then the first step where each request's tokens differ, and whether it is a
near-tie.

    python benchmark/accuracy/greedy_agreement.py collect --port 30000 --num 64 --out bcg.json
    python benchmark/accuracy/greedy_agreement.py compare bcg.json eager.json [--near-tie 0.05]

`collect` asks for the top-2 logprobs of every step (`return_logprob`, `top_logprobs_num`).
At a request's first diverging step both servers saw the same tokens before it, so the gap
between the two most likely tokens there says how close the call was: a divergence where either
server's gap is under `--near-tie` nats is a near-tie (rounding picked the other token).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random


async def collect(args) -> None:
    import aiohttp  # `compare` needs no HTTP client

    base = f"http://{args.host}:{args.port}"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        async with session.get(f"{base}/get_server_info") as resp:
            vocab = (await resp.json())["vocab_size"]
        rng = random.Random(args.seed)
        prompts = [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(args.num)]

        async def one(ids):
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": args.output_len, "temperature": 0.0,
                                                          "ignore_eos": True},
                    "return_logprob": True, "top_logprobs_num": 2}
            async with session.post(f"{base}/generate", json=body) as resp:
                if resp.status != 200:
                    raise SystemExit(f"HTTP {resp.status}: {await resp.text()}")
                out = await resp.json()
                # per step: [[logprob, id], [logprob, id]] of the two most likely tokens
                top2 = [[entry[:2] for entry in step] for step in out["meta_info"]["output_top_logprobs"]]
                return out["output_ids"], top2

        results = await asyncio.gather(*(one(p) for p in prompts))
    outputs, top2 = [r[0] for r in results], [r[1] for r in results]
    with open(args.out, "w") as f:
        json.dump({"seed": args.seed, "input_len": args.input_len, "outputs": outputs, "top2": top2}, f)
    print(f"collected {len(outputs)} greedy outputs of {args.output_len} tokens -> {args.out}")


def _gap(top2, step):
    """logprob of the most likely token minus the runner-up's at `step` (None if unknown)."""
    if top2 is None or step >= len(top2) or len(top2[step]) < 2:
        return None
    return top2[step][0][0] - top2[step][1][0]


def compare(a_path: str, b_path: str, near_tie: float = 0.05) -> dict:
    da, db = (json.load(open(p)) for p in (a_path, b_path))
    a, b = da["outputs"], db["outputs"]
    if len(a) != len(b):
        raise SystemExit(f"{a_path} has {len(a)} requests, {b_path} {len(b)}")
    ta, tb = da.get("top2", [None] * len(a)), db.get("top2", [None] * len(b))
    divergences = []
    for x, y, top_a, top_b in zip(a, b, ta, tb):
        step = next((i for i, (s, t) in enumerate(zip(x, y)) if s != t), None)
        if step is None and len(x) != len(y):
            step = min(len(x), len(y))
        if step is None:
            continue
        gaps = [g for g in (_gap(top_a, step), _gap(top_b, step)) if g is not None]
        divergences.append({"step": step, "gap_a": _gap(top_a, step), "gap_b": _gap(top_b, step),
                            "near_tie": (min(gaps) < near_tie) if gaps else None})
    divergences.sort(key=lambda d: d["step"])
    summary = {"requests": len(a), "identical": len(a) - len(divergences),
               "first_divergence_steps": [d["step"] for d in divergences],
               "near_tie_nats": near_tie,
               "near_ties": sum(1 for d in divergences if d["near_tie"]),
               "not_near_ties": sum(1 for d in divergences if d["near_tie"] is False),
               "divergences": divergences}
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
    m.add_argument("--near-tie", type=float, default=0.05, help="top-2 gap (nats) under which a divergence is a near-tie")
    args = p.parse_args()
    if args.cmd == "collect":
        asyncio.run(collect(args))
    else:
        compare(args.a, args.b, args.near_tie)


if __name__ == "__main__":
    main()
