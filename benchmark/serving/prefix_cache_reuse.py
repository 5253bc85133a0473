"""Time of a request whose prompt shares a long prefix with an earlier one, with prefix caching
off and on: the scheduler and a model runner in this process, greedy, one output token (so the
time is the prefill's). Prints one line per setting: median ms, forwards, cached_tokens.

    python benchmark/serving/prefix_cache_reuse.py --model-path dsv4-tiny --shared 1024 --tail 40
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default="dsv4-tiny", help="preset or checkpoint directory")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--shared", type=int, default=1024, help="tokens every prompt shares")
    p.add_argument("--tail", type=int, default=40, help="tokens of each prompt after the shared ones")
    p.add_argument("--page-size", type=int, default=128, help="tokens per KV page")
    p.add_argument("--chunked-prefill-size", type=int, default=512, help="prefill tokens per forward")
    p.add_argument("--repeats", type=int, default=3, help="timed requests per setting")
    a = p.parse_args(argv)
    if a.device != "cuda":
        torch.set_num_threads(1)  # CPU timings of tiny ops: threads only add synchronisation
    kw = dict(model_path=a.model_path, device=a.device, page_size=a.page_size,
              context_length=max(2048, a.shared + a.tail + 8), max_running_requests=4,
              max_total_tokens=8 * (a.shared + a.tail + a.page_size), chunked_prefill_size=a.chunked_prefill_size)
    on_cuda = torch.cuda.is_available()
    torch.manual_seed(0)
    runner = ModelRunner(ServerArgs(**kw).resolve(cuda_available=on_cuda))
    rng = random.Random(0)
    vocab = runner.config.vocab_size
    shared = [rng.randrange(2, vocab) for _ in range(a.shared)]

    def serve(s, rid):
        ids = shared + [rng.randrange(2, vocab) for _ in range(a.tail)]
        s.add_request(GenerateReqInput(rid=rid, input_ids=ids,
                                       sampling_params=SamplingParams(max_new_tokens=1, temperature=0.0)))
        n0, t0, outs = sum(s.num_forwards.values()), time.perf_counter(), []
        while s.has_work():
            outs += s.step()
        if on_cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0, sum(s.num_forwards.values()) - n0, outs[-1].cached_tokens

    for caching in (False, True):
        off = {} if caching else {"disable_radix_cache": True}  # on by default
        s = Scheduler(ServerArgs(**kw, **off).resolve(cuda_available=on_cuda), runner)
        serve(s, "warm-up")
        runs = [serve(s, f"r{k}") for k in range(a.repeats)]
        ms = statistics.median(r[0] for r in runs) * 1e3
        print(f"prefix caching {'on ' if caching else 'off'}: {a.shared + a.tail}-token prompt, {a.shared} shared: "
              f"median {ms:.0f} ms, {runs[-1][1]} forwards, cached_tokens {runs[-1][2]}")
        if s.prefix_caching is not None:
            s.prefix_caching.tree.reset()


if __name__ == "__main__":
    main()
