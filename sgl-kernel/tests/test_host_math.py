"""The host-side launch math equals Triton's constexpr functions it replaces."""

import pytest
import torch
from dsv4_kernels.host_math import cdiv, next_power_of_2, sm_count


def test_cdiv_is_tritons_for_every_small_pair():
    triton = pytest.importorskip("triton", exc_type=ImportError)
    for a in range(0, 700):
        for b in (1, 2, 3, 16, 31, 64, 128, 129):
            assert cdiv(a, b) == triton.cdiv(a, b) == -(-a // b), (a, b)


def test_next_power_of_2_is_tritons():
    triton = pytest.importorskip("triton", exc_type=ImportError)
    for n in list(range(0, 5000)) + [2**20 - 1, 2**20, 2**20 + 1, 2**31 - 1]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
    assert [next_power_of_2(n) for n in (0, 1, 2, 3, 5, 64, 65)] == [0, 1, 2, 4, 8, 64, 128]


def test_sm_count_off_cuda_is_an_h200s():
    # interpreter tests size their splits for the GPU the kernels are tuned on
    assert sm_count(torch.device("cpu")) == 132
