"""Model tests run tiny ops where intra-op threading only adds synchronisation: on a shared
2-core machine two OpenMP threads made the dsv4-tiny suite ~10x slower. Results do not depend
on the thread count; only the runtime does."""

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def _single_intra_op_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
