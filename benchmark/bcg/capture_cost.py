"""What capturing a serving configuration's graphs costs: seconds and graph-pool memory per
bucket (largest first), for the breakable (extend / mixed) and the decode graphs, at the
default bucket lists unless told otherwise. The target: all buckets in <= 10 s and
<= 3 GiB per GPU at flash-slice dims; nothing may grow with the context length, so run it at
two context lengths and compare the static buffers.

    python benchmark/bcg/capture_cost.py --model-path dsv4-flash-slice-fp8 --context-length 8192
    python benchmark/bcg/capture_cost.py --model-path dsv4-flash-slice-fp8 --context-length 1048576

Run it twice in a row on a fresh machine: the first run's capture includes Triton's JIT
compiles (a cold on-disk cache), the second is what a restarted server pays. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import logging
import time

MiB = 2**20


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default="dsv4-flash-slice-fp8")
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--context-length", type=int, default=8192)
    p.add_argument("--breakable-cuda-graph-max-tokens", type=int, default=None, help="default: the server's")
    p.add_argument("--mem-fraction-static", type=float, default=None)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    import torch

    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.server_args import ServerArgs

    overrides = {k: v for k, v in dict(
        num_layers=a.num_layers, breakable_cuda_graph_max_tokens=a.breakable_cuda_graph_max_tokens,
        mem_fraction_static=a.mem_fraction_static).items() if v is not None}
    args = ServerArgs(model_path=a.model_path, load_format="dummy", context_length=a.context_length,
                      enable_breakable_cuda_graph=True, **overrides).resolve(cuda_available=torch.cuda.is_available())
    start = time.perf_counter()
    runner = ModelRunner(args)
    startup = time.perf_counter() - start
    out = dict(what="capture_cost", model=a.model_path, num_layers=runner.config.num_hidden_layers,
               context_length=a.context_length, startup_s=round(startup, 1))
    for kind, graphs in runner.graph_runners.items():
        name = graphs.name
        out[name] = dict(
            buckets=list(graphs.buckets), capture_s=round(graphs.capture_seconds, 2),
            graph_pool_mib=round(graphs.graph_memory_bytes / MiB, 1),
            device_memory_taken_mib=round(graphs.capture_memory_bytes / MiB, 1),
            static_buffers_mib=round(graphs.static_buffer_bytes() / MiB, 2),
            mib_by_bucket={b: round(v / MiB, 1) for b, v in graphs.graph_memory_by_bucket.items()},
            s_by_bucket={b: round(v, 2) for b, v in graphs.capture_seconds_by_bucket.items()})
    print(json.dumps(out), flush=True)
    runner.shutdown()
    return out


if __name__ == "__main__":
    main()
