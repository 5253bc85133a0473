"""Runs every kernel microbenchmark in turn: python sgl-kernel/benchmark/run_all.py"""

import importlib
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

BENCHMARKS = ["bench_sparse_attention", "bench_cache_write", "bench_compressor", "bench_indexer",
              "bench_moe", "bench_moe_align"]


def main() -> int:
    failed = []
    for name in BENCHMARKS:
        try:
            importlib.import_module(name).main()
        except Exception:  # one broken benchmark must not hide the others' numbers
            traceback.print_exc()
            failed.append(name)
    print(f"benchmarks failed: {failed}" if failed else "all benchmarks ran")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
