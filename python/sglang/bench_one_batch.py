"""Breakable CUDA graph microbenchmark: one extend or mixed batch, timed three ways.

    python -m sglang.bench_one_batch --model-path dsv4-mini --num-tokens 16 64 256 1024 4096
    python -m sglang.bench_one_batch --modes decode --num-tokens 1 16 64   # decode graphs

eager: the whole step launched from Python. bcg: breakable-graph replay (metadata refresh,
padding, segments replayed, attention eager, logits head eager). ideal: one full CUDA graph
captured for that exact batch, attention included (GPU work only, the no-break bound).
Reports ms per step, eager/bcg and bcg/ideal, breaks per step, capture time, graph memory.
In decode mode (`--num-tokens` = batch sizes, one token per request) the bcg column is the
decode graph's replay, which holds the whole step; there is no separate ideal.
The limit column is the physical bound of the step on the GPU it ran on (planning/step_cost.py;
the H100 and H200 kinds' datasheet peaks, an H200's on paper on CPU, '-' on a GPU without known
peaks): HBM bytes / bandwidth (the weights the step's tokens touch, the KV they read), and for
extend and mixed the larger of that and FLOPs / peak (the FP8 peak for a release-format model,
bf16 otherwise); "% limit" is limit / (ideal, or the decode graph).

`--profile-kernels N` adds, under each row, the N largest kernels of one eager step (GPU time
from torch.profiler; op CPU time on CPU) with the step's kernel count: where a step goes at
real dims, decode included, from the same run. Decode rows add the same for one replay of the
decode graph (its attention splits differ from an eager step's). The result file keeps every
kernel of the step in launch order (`sequence_us`): a layer's kernel list is one period of it.

Every mode is warmed up before it is timed (Triton JIT compiles and autotuning must not land
in a timing), then timed in `--repeats` runs of `--iters` steps; the table gives the median
run and the JSON every run, so the spread is visible.

Under DP attention (`--dp-size N`, bench_one_batch_dp.py) N rank processes (rank r on cuda:r
with NCCL, or gloo on CPU) each build the model with 1/N of the routed experts and run the same
rows on a batch of their own, every step through the real DP step (consensus + forward with
the MoE collectives); the ideal graph holds the collectives too. Rank 0 prints the table with
four more columns: comm ms (the MoE collectives of one eager step, from torch.profiler: NCCL
kernels' GPU time, which includes waiting for a late rank, or gloo's collective spans on CPU),
comm % (of the eager step), and xfer ms / xfer % (the same collectives alone, back to back
from a barrier, times the MoE layers: their own time without the waits). The limit
is per rank (ep_size N). `--skip-ideal` leaves the ideal out ('-').

    python -m sglang.bench_one_batch --model-path dsv4-flash --load-format dummy --dp-size 2 \
        --num-tokens 16 256 4096 --modes mixed extend --iters 3 --repeats 3 --warmup 2
"""

from __future__ import annotations

import argparse

import torch

from sglang.bench_one_batch_dp import run_dp
from sglang.bench_one_batch_steps import Steps, run_bench, server_args_for
from sglang.srt.model_executor.model_runner import ModelRunner


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m sglang.bench_one_batch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default="dsv4-mini",
                   help="preset name or checkpoint directory, as for launch_server (default dsv4-mini)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda or cpu (default: cuda when available)")
    p.add_argument("--dtype", default=None, help="bfloat16 or float32 (default: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--load-format", default="auto", help="auto | dummy (random weights) | safetensors")
    p.add_argument("--num-layers", type=int, default=None, help="only the model's first N layers (same dims)")
    p.add_argument("--num-tokens", type=int, nargs="+", default=[16, 64, 256, 512, 1024, 2048, 4096],
                   help="tokens per step, one table row each (in decode mode: batch sizes); each is also a "
                        "breakable-graph bucket (default 16 64 256 512 1024 2048 4096)")
    p.add_argument("--modes", nargs="+", default=["extend", "mixed"], choices=["extend", "mixed", "decode"],
                   help="extend: prefill chunks only; mixed: one prefill chunk plus decode rows; decode: one "
                        "token per request, through the decode graph (default extend mixed)")
    p.add_argument("--prefix", type=int, default=1024, help="cached tokens per request (default 1024)")
    p.add_argument("--max-chunk", type=int, default=1024,
                   help="extend mode: the step's tokens split into prefill chunks of at most this many (default 1024)")
    p.add_argument("--decode-rows", type=int, default=32,
                   help="mixed mode: decode rows beside the prefill chunk, at most half the step's tokens "
                        "(default 32)")
    p.add_argument("--context-length", type=int, default=8192,
                   help="the runner's context length, capped at the model's max_position_embeddings (default 8192)")
    p.add_argument("--iters", type=int, default=10, help="steps per timed run")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per mode (median reported)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per mode before timing")
    p.add_argument("--attention-backend", default="auto", choices=("auto", "torch", "triton"),
                   help="the attention core (server_args --attention-backend; auto: triton on CUDA)")
    p.add_argument("--segment-kernels", default="auto", choices=("auto", "on", "off"),
                   help="dsv4_kernels ops inside graph segments (auto: with the Triton attention core)")
    p.add_argument("--moe-backend", default="auto", choices=("auto", "torch", "triton", "humming"),
                   help="who multiplies the FP4 routed experts (server_args --moe-backend)")
    p.add_argument("--quant-numerics", default="release", choices=["weight_only", "release"],
                   help="for release-format models (*-fp8 presets, FP8/FP4 checkpoints)")
    p.add_argument("--kv-cache-dtype", default=None, choices=["auto", "fp8_e4m3"],
                   help="auto: the model dtype; fp8_e4m3: KV nope dims in e4m3 (also in the limit column); "
                        "default: the server's (fp8_e4m3 with release numerics, else auto)")
    p.add_argument("--dp-size", type=int, default=1,
                   help="DP attention ranks (processes; rank r on cuda:r, or gloo on CPU), experts split N ways")
    p.add_argument("--dp-timeout", type=float, default=600.0, help="DP: seconds any collective may wait")
    p.add_argument("--skip-ideal", action="store_true", help="no ideal graph (its column shows '-')")
    p.add_argument("--profile-kernels", type=int, default=0, metavar="N",
                   help="after each row, the N largest kernels of one eager step (torch.profiler; GPU time on "
                        "CUDA, op CPU time on CPU), with the step's kernel count")
    p.add_argument("--result-file", default=None, help="write the result (every row and run) there as JSON")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = make_parser()
    a = p.parse_args(argv)
    if a.dp_size < 1:
        p.error(f"--dp-size must be >= 1, got {a.dp_size}")
    return a


def main(argv=None) -> dict:
    """Runs the benchmark; returns the result (rank 0's under DP, see bench_one_batch_dp)."""
    a = parse_args(argv)
    if a.dp_size > 1:
        return run_dp(a)
    runner = ModelRunner(server_args_for(a), cuda_graph_on_cpu="decode" in a.modes)  # CPU: the emulator
    try:
        return run_bench(a, runner, Steps(runner))
    finally:
        runner.shutdown()


if __name__ == "__main__":
    main()
