"""Where a speculative step's time goes: one request at a time through an in-process engine,
every scheduler step timed, and inside it each part of the speculative step (the target's
verify forward, the LM head, acceptance, ring snapshots, each MTP forward) timed with a device
synchronisation around it, so each row is that part's host + device time. Without
`--speculative-algorithm` the same loop times plain decode steps: run it once each way.

    python benchmark/profiling/speculative_step.py --model-path dsv4-flash --load-format dummy \
        --num-layers 20 --enable-breakable-cuda-graph --speculative-algorithm mtp \
        [--num-requests 3 --input-len 1024 --output-len 128]

Set SGLANG_SIMULATE_ACCEPT_LENGTH to pin the accepted drafts (random weights accept none).
The synchronisations serialise host and device, so the parts add up to a little more than an
unprofiled step; the step row is measured the same way. Drafting contains the MTP forwards and
their LM heads: those rows overlap.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import random
import statistics
import time

import torch

from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args_cli import add_cli_args, from_cli_args


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(obj, name: str, label: str, log: dict, device) -> None:
    """Replace obj.name with a wrapper that adds its synchronised wall time to log[label]."""
    fn = getattr(obj, name)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        _sync(device)
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _sync(device)
            log[label].append(time.perf_counter() - t)

    setattr(obj, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_cli_args(parser)
    parser.add_argument("--num-requests", type=int, default=3)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    args = parser.parse_args()
    # one step = one forward: what this tool times
    server_args = dataclasses.replace(from_cli_args(args), disable_overlap_schedule=True)

    from sglang.srt.entrypoints.engine import Engine
    from sglang.srt.speculative import ring_snapshot

    overrides = {k: v for k, v in vars(server_args).items() if k not in ("model_path", "resolved")}
    engine = Engine(model_path=server_args.model_path, **overrides)
    sched = engine.scheduler
    runner, device = sched.model_runner, sched.device
    log = collections.defaultdict(list)
    _timed(runner, "forward_hidden", "target forward (verify)", log, device)
    _timed(runner, "forward_mtp", "MTP forward", log, device)
    _timed(runner.model, "compute_logits", "LM head", log, device)
    spec = getattr(sched, "speculator", None)
    if spec is not None:
        _timed(spec, "_accept", "acceptance (host, includes the argmax read)", log, device)
        _timed(spec, "_draft", "drafting (MTP forwards, heads, draft choice)", log, device)
        _timed(ring_snapshot.RingSnapshot, "restore", "ring restore", log, device)
        init = ring_snapshot.RingSnapshot.__init__
        _timed(ring_snapshot.RingSnapshot, "__init__", "ring snapshot", log, device)
        assert ring_snapshot.RingSnapshot.__init__ is not init

    rng = random.Random(0)
    steps, tokens = [], 0
    for n in range(args.num_requests + 1):  # the first request warms up
        ids = [rng.randrange(3, min(30000, sched.vocab_size)) for _ in range(args.input_len)]
        sched.add_request(GenerateReqInput(rid=f"r{n}", input_ids=ids, sampling_params=SamplingParams(
            max_new_tokens=args.output_len, temperature=0.0, ignore_eos=True)))
        if n == 0:
            while sched.has_work():
                sched.step()
            log.clear()
            continue
        while sched.has_work():
            _sync(device)
            t = time.perf_counter()
            outs = sched.step()
            _sync(device)
            steps.append(time.perf_counter() - t)
            tokens += sum(len(o.new_token_ids) for o in outs)
    ms = lambda xs: 1e3 * statistics.median(xs)  # noqa: E731
    total = sum(steps)
    print(f"{len(steps)} steps, {tokens} tokens: {1e3 * total / max(tokens, 1):.2f} ms per output token, "
          f"step median {ms(steps):.2f} ms (p10 {1e3 * sorted(steps)[len(steps) // 10]:.2f}, "
          f"p90 {1e3 * sorted(steps)[9 * len(steps) // 10]:.2f})")
    print(f"{'part':<48}{'calls':>7}{'per step':>10}{'median ms':>11}{'ms per step':>13}{'share':>8}")
    for label, xs in sorted(log.items(), key=lambda kv: -sum(kv[1])):
        print(f"{label:<48}{len(xs):>7}{len(xs) / len(steps):>10.2f}{ms(xs):>11.3f}"
              f"{1e3 * sum(xs) / len(steps):>13.3f}{sum(xs) / total:>8.1%}")
    if spec is not None:
        print({k: round(v, 3) for k, v in spec.get_stats().items()})
    engine.shutdown()


if __name__ == "__main__":
    main()
