"""Test tiers and shared fixtures: GPU tests skip cleanly on CPU-only machines."""

import os
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]

if not torch.cuda.is_available():
    # Tests that call the Triton kernels directly run them under the interpreter on CPU; it
    # must be set before any dsv4_kernels kernel module imports triton (as in
    # sgl-kernel/tests/conftest.py). The model's own CPU paths never reach Triton.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", help="also run the long `slow` variants")


def pytest_collection_modifyitems(config, items):
    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    # Only long twins of fast tests carry `slow`: skipping them hides no required check.
    run_slow = config.getoption("--run-slow") or os.environ.get("SGLANG_TEST_SLOW") == "1"
    for item in items:
        if item.get_closest_marker("slow") and not run_slow:
            item.add_marker(pytest.mark.skip(reason="long variant: pass --run-slow"))
        if item.get_closest_marker("gpu") and num_gpus < 1:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if item.get_closest_marker("multi_gpu") and num_gpus < 2:
            item.add_marker(pytest.mark.skip(reason=f"needs 2+ CUDA GPUs, found {num_gpus}"))


@pytest.fixture(scope="session")
def dsv4_reference_dir() -> Path:
    """The DeepSeek-V4 reference data (conformance checkpoints, real configs, chat encodings):
    test/data/dsv4-reference, which the repository carries, or DSV4_REFERENCE_DIR. Missing data
    fails the tests that need it: a conformance check must never pass by being skipped."""
    override = os.environ.get("DSV4_REFERENCE_DIR")
    path = Path(override or REPO_ROOT / "test" / "data" / "dsv4-reference")
    if not (path / "conformance-tiny" / "model.safetensors").is_file():
        where = (f"DSV4_REFERENCE_DIR={override} holds no conformance-tiny/model.safetensors" if override else
                 f"{path} is missing: it is part of the repository (restore it, or set DSV4_REFERENCE_DIR)")
        pytest.fail(f"DSV4 reference data not found: {where}", pytrace=False)
    return path


@pytest.fixture(scope="module")
def single_intra_op_thread():
    """Tests of tiny CPU ops: intra-op threading only adds synchronisation (on a shared 2-core
    machine two OpenMP threads made the dsv4-tiny suite ~10x slower). Results do not depend on
    the thread count; only the runtime does. Modules opt in with
    `pytestmark = pytest.mark.usefixtures("single_intra_op_thread")`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

