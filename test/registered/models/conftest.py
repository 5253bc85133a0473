"""Every model test runs with one intra-op thread (test/conftest.py's single_intra_op_thread)."""

import pytest


@pytest.fixture(scope="module", autouse=True)
def _single_intra_op_thread(single_intra_op_thread):
    yield
