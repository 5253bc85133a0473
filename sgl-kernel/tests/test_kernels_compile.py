"""Every Triton kernel compiles for an H200 (sm_90), checked on a machine without a GPU.

The interpreter the other CPU tests use accepts code that Triton's compiler rejects (see
triton_compile_only.py), so this test runs the kernel tests once more in compile-only mode
(every launch compiled with the tests' own arguments, none run) and reads the report.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parent
KERNELS = TESTS.parent / "python" / "dsv4_kernels"

# Kernels the compile-only run cannot reach, with the reason.
NOT_REACHED = {
    # moe_align launches it for CUDA tensors or under the interpreter only; on CPU tensors it
    # takes the torch path. Its GPU tests compile it on the H200.
    "dsv4_kernels.moe._align_one_kernel",
    "dsv4_kernels.moe_act._align_quant_kernel",  # the same path's combined launch
}


def defined_kernels() -> set:
    """Every `@triton.jit` function whose name ends in `_kernel` (the launched ones; the
    helpers they call are compiled with them)."""
    names = set()
    for path in KERNELS.glob("*.py"):
        for name in re.findall(r"@triton\.jit[^\n]*\ndef (\w+_kernel)\(", path.read_text()):
            names.add(f"dsv4_kernels.{path.stem}.{name}")
    return names


def compile_all(tmp_path) -> dict:
    """The kernel tests in compile-only mode, the files dealt over one process per core (the
    compiles are single-threaded): their reports merged."""
    files = sorted(TESTS.glob("test_*.py"), key=lambda f: -f.stat().st_size)  # the largest first, dealt round
    n = max(1, min(4, os.cpu_count() or 1))
    runs = []
    for i, shard in enumerate(files[i::n] for i in range(n)):
        report = tmp_path / f"report{i}.json"
        env = dict(os.environ, DSV4_TRITON_COMPILE_ONLY="1", DSV4_TRITON_COMPILE_REPORT=str(report))
        env.pop("TRITON_INTERPRET", None)
        # The tests' assertions fail in this mode (nothing runs); only the report counts.
        log = tmp_path / f"log{i}.txt"  # a file, not a pipe: a full pipe would stall the shard
        with open(log, "w") as out:
            proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *map(str, shard)],
                                    cwd=TESTS.parent, env=env, stdout=out, stderr=subprocess.STDOUT)
        runs.append((report, log, proc))
    got = {"compiled": {}, "pdl_compiled": [], "errors": {}}
    for report, log, proc in runs:
        proc.wait(timeout=1200)
        assert report.exists(), log.read_text()[-3000:]
        part = json.loads(report.read_text())
        for name, count in part["compiled"].items():
            got["compiled"][name] = got["compiled"].get(name, 0) + count
        got["pdl_compiled"] += part["pdl_compiled"]
        got["errors"].update(part["errors"])
    return got


def pdl_kernels() -> set:
    """The launched kernels that take the PDL constexpr (pdl.py)."""
    names = set()
    for path in KERNELS.glob("*.py"):
        for name in re.findall(r"@triton\.jit[^\n]*\ndef (\w+_kernel)\([^)]*PDL: tl\.constexpr", path.read_text()):
            names.add(f"dsv4_kernels.{path.stem}.{name}")
    return names


@pytest.mark.skipif(os.environ.get("DSV4_TRITON_COMPILE_ONLY") == "1", reason="the compile-only run itself")
@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the kernel tests compile every kernel themselves")
@pytest.mark.timeout(1500)  # a cold Triton cache on two cores: 12.5 min (one process alone: over 15)
def test_every_kernel_compiles_for_sm90(tmp_path):
    pytest.importorskip("triton")
    got = compile_all(tmp_path)
    assert got["errors"] == {}, "\n\n".join(f"{k}:\n{v}" for k, v in got["errors"].items())
    missing = defined_kernels() - set(got["compiled"]) - NOT_REACHED
    assert missing == set(), f"kernels no test launches, so never compiled: {sorted(missing)}"
    assert NOT_REACHED <= defined_kernels(), "NOT_REACHED names a kernel that no longer exists"
    pdl_missing = pdl_kernels() - set(got["pdl_compiled"]) - NOT_REACHED
    assert pdl_missing == set(), f"PDL-aware kernels never compiled with PDL on: {sorted(pdl_missing)}"
