"""Compile every Triton launch for an H200 (sm_90) on a machine without a GPU.

The CPU tests run the kernels under Triton's interpreter, which accepts code the compiler
rejects: a module-level int read inside a kernel (only `tl.constexpr` globals compile), a
`tl.dot` with K < 16. Each costs a GPU call to find. In this mode (`DSV4_TRITON_COMPILE_ONLY=1`,
set up by conftest.py before any kernel module imports triton) the kernel tests run without
the interpreter: every launch is compiled for sm_90 with Triton's own compiler and not run.
Outputs are never written, so the tests' assertions fail; what counts is the report written at
the end (`DSV4_TRITON_COMPILE_REPORT`): every kernel compiled, every compile error. A kernel
that takes `PDL` (pdl.py) also compiles once with it on, as a Hopper launches it.
test_kernels_compile.py runs the kernel tests this way and checks the report.
"""

from __future__ import annotations

import json
import os
from collections import Counter

TARGET = ("cuda", 90, 32)  # H200: sm_90, warp size 32

compiled: Counter = Counter()
errors: dict = {}
pdl_compiled: set = set()


class _NoGpuDriver:
    """What JITFunction needs of the active driver to compile (never to launch)."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget(*TARGET)

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")

    def is_active(self):
        return True


def install() -> None:
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    driver.set_active(_NoGpuDriver())
    run = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        name = f"{self.fn.__module__}.{self.fn.__name__}"
        try:
            kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
            if "PDL" in self.arg_names and name not in pdl_compiled:  # once as a Hopper launches it too
                pdl_compiled.add(name)
                run(self, *args, grid=grid, warmup=True, **{**kwargs, "PDL": True, "launch_pdl": True})
        except Exception as e:  # noqa: BLE001 - every compile error is reported, then raised
            errors.setdefault(name, f"{type(e).__name__}: {e}"[:2000])
            raise
        compiled[name] += 1
        return kernel

    JITFunction.run = compile_only


def write_report() -> None:
    path = os.environ.get("DSV4_TRITON_COMPILE_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump({"target": list(TARGET), "compiled": dict(compiled), "pdl_compiled": sorted(pdl_compiled),
                       "errors": errors}, f, indent=1)
