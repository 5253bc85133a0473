"""sgl-kernel/benchmark/sm90_resources.py keeps up with the kernels' signatures: every report it
prints passes each constexpr its kernel takes (compile_report refuses a report that leaves one
out, which would compile as a runtime argument), checked with Triton's compiler and cuobjdump
stood in for, so it costs no compile. In a process of its own: the tests' interpreter mode
(conftest.py) turns kernels into interpreted functions, which have no signature to check."""

import os
import subprocess
import sys

import pytest

from sglang.test.repo_scripts import REPO

RUN = """
import sys
from types import SimpleNamespace
sys.path.insert(0, "sgl-kernel/benchmark")
import sm90_resources as r
compiled = []
def fake_compile(src, target, options):
    compiled.append(src.fn.__name__)
    return SimpleNamespace(asm={"cubin": b"", "ptx": "wgmma"}, metadata=SimpleNamespace(shared=0))
r.triton.compile = fake_compile
r.subprocess.run = lambda *a, **k: SimpleNamespace(stdout="REG:100 STACK:0")
r.main()
print("COMPILED", ",".join(compiled))
"""


def test_every_report_names_each_constexpr_of_its_kernel():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", RUN], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    compiled = run.stdout.split("COMPILED ")[-1].strip().split(",")
    assert {"_sparse_attn_kernel", "_merge_splits_kernel", "_norm_rope_row_kernel", "_compressor_pool_kernel",
            "_compressor_emit_kernel", "_indexer_logits_kernel", "_select_topk_kernel",
            "_fp8_gemv_kernel"} <= set(compiled)
    # one line per report, each with the stand-in's figures
    lines = [line for line in run.stdout.splitlines() if "regs" in line]
    assert len(lines) == len(compiled) and all("regs  100  spill-stack     0" in line for line in lines)
