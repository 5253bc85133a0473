"""conformance-tiny-fp8fp4's release-numerics rows (DeepSeek's reference logits) with each KV
cache dtype, on the given devices, eagerly: an FP8 cache holds exactly the values the float
cache's nope rounding keeps, so the two rows sets should agree with each other.

    python benchmark/accuracy/release_rows_by_kv_dtype.py cuda cpu
"""

import sys
from pathlib import Path

from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "test" / "registered" / "models"))

from test_dsv4_conformance_fp8fp4 import agreement, all_rows  # noqa: E402

from sglang.srt.model_executor.model_runner import ModelRunner  # noqa: E402
from sglang.test.runner_args import cpu_server_args  # noqa: E402


def main(devices):
    ckpt = REPO / "test" / "data" / "dsv4-reference" / "conformance-tiny-fp8fp4"
    expected = load_file(str(ckpt / "expected.safetensors"))
    for device in devices:
        for kv in ("auto", "fp8_e4m3"):
            runner = ModelRunner(cpu_server_args(model_path=str(ckpt), context_length=512, max_total_tokens=2048,
                                                 dtype="float32", device=device, quant_numerics="release",
                                                 kv_cache_dtype=kv, disable_cuda_graph=True))
            a = agreement(all_rows(runner, expected), expected["logits"])
            print(f"{device} kv {kv}: min cos {a['min_cos']:.6f} mean {a['mean_cos']:.6f} argmax agreement "
                  f"{a['argmax_agree']:.3f}, differing rows {a['differing_rows']}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["cpu"])
