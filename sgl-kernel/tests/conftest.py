"""Kernel tests run on their own (without the runtime's test/): same GPU tiers as test/conftest.py.

Without a GPU the Triton kernels run under the interpreter (TRITON_INTERPRET=1 is set here,
before any kernel module imports triton); with one, the small-shape tests run compiled on it.
"""

import os
import sys
import zlib
from pathlib import Path

import pytest
import torch

# Importable without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

COMPILE_ONLY = os.environ.get("DSV4_TRITON_COMPILE_ONLY") == "1" and not torch.cuda.is_available()
if COMPILE_ONLY:  # every launch compiled for sm_90, none run (triton_compile_only.py)
    import triton_compile_only

    triton_compile_only.install()
elif not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    # Registered here too so these tests also run outside the repository's pyproject.
    config.addinivalue_line("markers", "gpu: needs one CUDA GPU")
    config.addinivalue_line("markers", "multi_gpu: needs two or more CUDA GPUs")


def pytest_sessionfinish(session, exitstatus):
    if COMPILE_ONLY:
        triton_compile_only.write_report()


def pytest_collection_modifyitems(config, items):
    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for item in items:
        if item.get_closest_marker("gpu") and num_gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if item.get_closest_marker("multi_gpu") and num_gpus < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs 2+ CUDA GPUs, found {num_gpus}"))


@pytest.fixture
def device() -> str:
    """Where the small-shape kernel tests run: the GPU if there is one, else the interpreter."""
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    # Fresh random inputs per test, but reproducible from the test id when one fails.
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(scope="module")
def flash_experts():
    """8 FP4 experts at Flash's dims, quantized once per module and moved to the GPU (the
    fp4 MoE kernel files' gpu tests)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from kernel_test_utils import fp4_experts

    torch.manual_seed(0)
    return fp4_experts(8, 4096, 2048, "cuda")
