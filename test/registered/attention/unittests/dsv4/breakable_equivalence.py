"""Harness for breakable-graph equivalence: drives identical request histories through three
runners (graph replay, eager on the padded static batch, plain eager) and compares."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import List

import torch

from sglang.srt.model_executor.forward_batch_info import ForwardMode, build_forward_batch
from sglang.srt.model_executor.graph_dispatch import PathKind, decide_step_path, describe
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.test.runner_args import cpu_server_args

TINY = dict(model_path="dsv4-tiny", context_length=1024, max_total_tokens=16384, max_running_requests=12)


def make_runners(buckets, **over):
    cfg = dict(TINY, **over)
    breakable = ModelRunner(cpu_server_args(**cfg, enable_breakable_cuda_graph=True, breakable_cuda_graph_tokens=list(buckets),
                                      breakable_cuda_graph_max_tokens=max(buckets)))
    padded = ModelRunner(cpu_server_args(**cfg))
    eager = ModelRunner(cpu_server_args(**cfg))
    return breakable, padded, eager


@dataclass
class Req:
    slots: List[int]
    length: int = 0


@dataclass
class Mismatch:
    step: int
    what: str
    diff: float


@dataclass
class Report:
    batches: int = 0
    modes: dict = field(default_factory=dict)
    tokens: List[int] = field(default_factory=list)
    mismatches: List[Mismatch] = field(default_factory=list)
    max_unpadded_diff: float = 0.0


def random_batch(rng: random.Random, live: List[Req], target: int, max_reqs: int, new_req):
    """A batch of about `target` tokens: decode rows, chunked continuations, new prefills."""
    rows = []
    budget = target
    pool = list(live)
    rng.shuffle(pool)
    decode_share = 0.35 if rng.random() < 0.7 else 0.0  # some batches are pure EXTEND
    for r in pool:  # some running requests decode one token (these make the batch MIXED)
        if budget > 1 and rng.random() < decode_share and r.length > 0 and len(rows) < max_reqs - 1:
            rows.append((r, 1))
            budget -= 1
    extend = []
    for r in pool:
        if budget < 2 or len(rows) + len(extend) >= max_reqs:
            break  # a 1-token continuation of a running request would be a decode row
        if any(r is x for x, _ in rows):
            continue
        if rng.random() < 0.5:
            n = min(budget, rng.choice([1, 3, 4, 5, 7, 8, 9, 31, 64, 127, 128, 129]) if r.length else budget)
            n = max(2, n)
            extend.append((r, n))
            budget -= n
    while budget > 0 and len(rows) + len(extend) < max_reqs:
        r = new_req()
        if r is None:
            break
        n = budget if rng.random() < 0.5 else rng.randint(1, budget)
        extend.append((r, n))
        budget -= n
    if budget > 0:  # out of request slots: give the leftover tokens to one prefill chunk
        r, n = extend[0]
        extend[0] = (r, n + budget)
    return extend + rows  # prefill chunks first, then decode rows


def run_equivalence(runners, buckets, batches_per_bucket: int, seed: int = 0, max_len: int = 700,
                    atol_unpadded: float = 1e-4) -> Report:
    breakable, padded, eager = runners
    graph_runner = breakable.breakable_runner
    padded_runner = _padded_view(padded, graph_runner)
    rng = random.Random(seed)
    live: List[Req] = []
    report = Report()

    def new_req():
        if breakable.req_to_token_pool.slots.num_free == 0:
            return None
        r = Req([m.req_to_token_pool.alloc_req() for m in runners])
        live.append(r)
        return r

    lows = [0] + list(buckets[:-1])
    step = 0
    for lo, hi in zip(lows, buckets):
        for i in range(batches_per_bucket):
            # at the bucket size, just under it, or anywhere the runner accepts for this bucket
            lowest = max(lo + 1, -(-hi // 3))
            target = hi if i % 4 == 0 else (hi - 1 if i % 4 == 1 and hi - 1 > lo else rng.randint(lowest, hi))
            while len(live) > breakable.req_to_token_pool.max_num_reqs - 3:  # keep slots for new prefills
                _free(runners, live, max(live, key=lambda r: r.length))
            batch = random_batch(rng, live, target, breakable.req_to_token_pool.max_num_reqs - 1, new_req)
            _run_and_compare(runners, graph_runner, padded_runner, batch, report, step, atol_unpadded)
            report.batches += 1
            step += 1
            for r in [r for r in live if r.length > max_len]:
                _free(runners, live, r)
    return report


def run_long_prefills(runners, chunk: int, total_len: int, num_reqs: int = 2) -> Report:
    """A deterministic schedule that reaches deep positions in few batches: `num_reqs`
    requests prefilled `chunk` tokens per step (one of them staggered, so emissions fall at
    different rows) up to `total_len`, each step with a decode row of an earlier request once
    one exists. Every multiple of 128 crossed inside a replayed step emits a c128 block there
    (and every multiple of 4 a c4 block)."""
    breakable = runners[0]
    graph_runner = breakable.breakable_runner
    padded_runner = _padded_view(runners[1], graph_runner)
    report = Report()
    reqs = [Req([m.req_to_token_pool.alloc_req() for m in runners]) for _ in range(num_reqs)]
    decoder = Req([m.req_to_token_pool.alloc_req() for m in runners])
    step = 0
    while min(r.length for r in reqs) < total_len:
        batch = []
        for i, r in enumerate(reqs):
            n = min(chunk - 8 * i if r.length == 0 else chunk, total_len - r.length)
            if n > 0:
                batch.append((r, n))
        batch.append((decoder, 5 if decoder.length == 0 else 1))
        _run_and_compare(runners, graph_runner, padded_runner, batch, report, step, 1e-4)
        report.batches += 1
        step += 1
    for r in reqs + [decoder]:
        _free(runners, [r], r)
    return report


def run_scripted(runners, script, atol_unpadded: float = 1e-4) -> Report:
    """Batches given as lists of (request name, new tokens); a name's first row starts a new
    request (freed once the script ends)."""
    graph_runner = runners[0].breakable_runner
    padded_runner = _padded_view(runners[1], graph_runner)
    report, reqs = Report(), {}
    for step, rows in enumerate(script):
        batch = []
        for name, n in rows:
            if name not in reqs:
                reqs[name] = Req([m.req_to_token_pool.alloc_req() for m in runners])
            batch.append((reqs[name], n))
        _run_and_compare(runners, graph_runner, padded_runner, batch, report, step, atol_unpadded)
        report.batches += 1
    for r in list(reqs.values()):
        _free(runners, [r], r)
    return report


def _run_and_compare(runners, graph_runner, padded_runner, batch, report, step, atol_unpadded) -> None:
    """One batch on the three runners (replay, padded eager, unpadded eager); mismatches into
    `report`; every request's length advanced."""
    outs = []
    for k, m in enumerate(runners):
        rtp = m.req_to_token_pool
        for r, n in batch:
            rtp.ensure_capacity(r.slots[k], r.length + n)
        toks = [[(r.slots[0] * 31 + r.length + j * 7) % 500 + 3 for j in range(n)] for r, n in batch]
        has_decode = any(n == 1 and r.length > 0 for r, n in batch)
        has_extend = any(not (n == 1 and r.length > 0) for r, n in batch)
        mode = ForwardMode.MIXED if has_decode and has_extend else (
            ForwardMode.DECODE if has_decode else ForwardMode.EXTEND)
        assert mode != ForwardMode.DECODE, "random_batch always has an extend row"
        fb = build_forward_batch(mode, [r.slots[k] for r, _ in batch], [r.length for r, _ in batch],
                                 toks, m.device)
        if k == 0:
            path = decide_step_path((describe(fb),), m.graph_tables)
            assert path.kind == PathKind.BREAKABLE, path.reason
            outs.append(graph_runner.replay_hidden(fb, path.size)[:fb.num_tokens].clone())
        elif k == 1:
            outs.append(padded_runner(fb)[:fb.num_tokens].clone())
        else:
            with torch.inference_mode():
                m.attn_backend.init_forward_metadata(fb)
                from sglang.srt.model_executor.forward_context import forward_context
                with forward_context(fb, m.attn_backend):
                    outs.append(m.model(fb.input_ids).clone())
    report.modes[mode.name] = report.modes.get(mode.name, 0) + 1
    report.tokens.append(fb.num_tokens)
    for r, n in batch:
        r.length += n
    d_pad = (outs[0] - outs[1]).abs().max().item()
    d_raw = (outs[0] - outs[2]).abs().max().item()
    report.max_unpadded_diff = max(report.max_unpadded_diff, d_raw)
    if d_pad != 0.0:
        report.mismatches.append(Mismatch(step, "replay vs eager on the padded batch", d_pad))
    if d_raw > atol_unpadded:
        report.mismatches.append(Mismatch(step, "replay vs unpadded eager", d_raw))


def _free(runners, live, r) -> None:
    for k, m in enumerate(runners):
        m.req_to_token_pool.free_req(r.slots[k])
    live.remove(r)


def _padded_view(runner, graph_runner):
    """Eager forward on the padded static batch, using a runner-local copy of the buffers."""
    from sglang.srt.model_executor.graph_runner import BreakableCudaGraphRunner

    twin = BreakableCudaGraphRunner(runner, graph_runner.buckets)
    return twin.forward_padded_eager
