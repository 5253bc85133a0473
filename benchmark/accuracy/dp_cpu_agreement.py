"""DP attention at any world size on CPU (gloo): the random-schedule harness of
test/registered/dp, N rank processes, then each rank's outputs against one eager process.

    python benchmark/accuracy/dp_cpu_agreement.py --world 4 --steps 300
"""

import argparse
import os
import tempfile
import time

import torch
import torch.multiprocessing as mp

from sglang.test.dp_harness import dp_rank_main, eager_reference
from sglang.test.server_process import free_port


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--idle-policy", default="replay")
    p.add_argument("--seed", type=int, default=7)
    a = p.parse_args()
    port = free_port()
    out = tempfile.mkdtemp()
    start = time.perf_counter()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=dp_rank_main, args=(r, a.world, port, a.steps, a.seed, a.idle_policy, out),
                         kwargs=dict(timeout_s=120)) for r in range(a.world)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=1800)
    print(f"dp={a.world} {a.steps} steps in {time.perf_counter() - start:.1f}s (idle policy {a.idle_policy})")
    for r in range(a.world):
        err = os.path.join(out, f"rank{r}.err")
        if os.path.exists(err):
            print(f"rank {r} FAILED:\n{open(err).read()[-2000:]}")
            continue
        res = torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False)
        worst = eager_reference(a.seed, r, a.steps, res["records"])
        print(f"rank {r}: paths {res['paths']} max|logit diff| vs one eager process {worst:.2e}")


if __name__ == "__main__":
    main()
