"""BCG against eager, chunk by chunk, on dsv4-mini-fp8 (dummy weights) over many token seeds:
how far a padded chunk's logits move when only the GEMM tilings differ.

Each prompt is 600 tokens prefilled in chunks of 256, 256 and 88. The 256-token chunks run the
same kernels at the same shapes in both modes; the 88-token chunk runs at 88 rows eagerly and
padded to 256 in the graph. Prints, per seed, the cosine of each chunk's last-token logits and
an eager rerun's (determinism). It tells a defect from release numerics'
sensitivity (test_release_format_gpu.py's bounds); compare two source trees by running it
under each one's PYTHONPATH.

    python benchmark/bcg/probe_padded_chunk.py LABEL [SEEDS] [CASES]

CASES: how many of (release, fp8 KV), (release, bf16 KV), (weight-only, bf16 KV) to run.
Needs a CUDA GPU.
"""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "test" / "registered" / "models"))
from dsv4_harness import prefill_in_chunks  # noqa: E402

from sglang.srt.model_executor.model_runner import ModelRunner  # noqa: E402
from sglang.test.runner_args import cpu_server_args  # noqa: E402

CASES = [("release", "fp8_e4m3"), ("release", "auto"), ("weight_only", "auto")]
CHUNKS = [256, 256, 88]


def runner(bcg: bool, kv: str, numerics: str) -> ModelRunner:
    return ModelRunner(cpu_server_args(model_path="dsv4-mini-fp8", dtype="bfloat16", device="cuda",
                                       context_length=2048, max_total_tokens=8192, max_running_requests=4,
                                       quant_numerics=numerics, kv_cache_dtype=kv, enable_breakable_cuda_graph=bcg,
                                       breakable_cuda_graph_tokens=[256] if bcg else None))


def main(argv) -> int:
    if not torch.cuda.is_available():
        print("probe_padded_chunk: needs a CUDA GPU")
        return 1
    label = argv[0] if argv else "tree"
    seeds = range(int(argv[1]) if len(argv) > 1 else 6)
    cases = CASES[: int(argv[2]) if len(argv) > 2 else len(CASES)]
    for numerics, kv in cases:
        eager, graphs = runner(False, kv, numerics), runner(True, kv, numerics)
        for seed in seeds:
            tokens = torch.randint(2, 32768, (600,), generator=torch.Generator().manual_seed(seed)).tolist()
            a = torch.stack(prefill_in_chunks(eager, tokens, CHUNKS)).float()
            a2 = torch.stack(prefill_in_chunks(eager, tokens, CHUNKS)).float()
            b = torch.stack(prefill_in_chunks(graphs, tokens, CHUNKS)).float()
            cos = F.cosine_similarity(a, b, dim=-1).tolist()
            rerun = F.cosine_similarity(a, a2, dim=-1).min().item()
            print(f"{label} {numerics} kv {kv} seed {seed}: BCG vs eager cos per chunk "
                  f"{[round(c, 6) for c in cos]}, eager rerun {rerun:.6f}", flush=True)
        del eager, graphs
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
