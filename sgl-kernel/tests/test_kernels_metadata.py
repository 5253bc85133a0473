"""Metadata builders: window / compressed slot lists and cache write locations per token."""

import pytest
import torch

from dsv4_kernels import ops


@pytest.fixture
def page_table(device):
    # Two request slots of 300 positions; request 1 owns raw slots 1000.. in reverse pages.
    req_to_token = torch.full((3, 300), -7, dtype=torch.int32)
    req_to_token[0] = torch.arange(300, dtype=torch.int32) + 512
    req_to_token[2] = (torch.arange(300, dtype=torch.int32) % 128) + 128 * (9 - torch.arange(300) // 128) + 1000
    return req_to_token.to(device)


def test_window_slots_are_the_last_w_positions_left_aligned(device, page_table):
    req = torch.tensor([0, 0, 2, 2], device=device)
    pos = torch.tensor([0, 2, 5, 299], device=device)
    slots, lens = ops.window_metadata(page_table, req, pos, window=4)
    assert slots.dtype == torch.int32 and lens.tolist() == [1, 3, 4, 4]
    assert slots[0].tolist() == [512, -1, -1, -1]
    assert slots[1].tolist() == [512, 513, 514, -1]
    assert slots[2].tolist() == page_table[2, 2:6].tolist()
    assert slots[3].tolist() == page_table[2, 296:300].tolist()


@pytest.mark.parametrize("ratio", [4, 128])
def test_compressed_slots_follow_the_last_token_of_each_entry(device, page_table, ratio):
    req = torch.tensor([0, 2, 2, 2, 0], device=device)
    pos = torch.tensor([2, 3, 127, 299, 254], device=device, dtype=torch.int32)
    max_entries = 300 // ratio
    slots, lens = ops.compressed_metadata(page_table, req, pos, ratio, max_entries)
    assert slots.shape == (5, max_entries)
    for t in range(5):
        n = (int(pos[t]) + 1) // ratio
        assert lens[t] == n
        expected = [int(page_table[req[t], ratio * i + ratio - 1]) // ratio for i in range(n)]
        assert slots[t].tolist() == expected + [-1] * (max_entries - n)


def test_out_locs_mark_emitting_tokens(device, page_table):
    req = torch.tensor([0, 0, 2, 2], device=device)
    pos = torch.tensor([3, 4, 127, 255], device=device)
    raw, c4, c128 = ops.out_locs(page_table, req, pos)
    assert raw.tolist() == [515, 516, int(page_table[2, 127]), int(page_table[2, 255])]
    assert c4.tolist() == [515 // 4, -1, int(page_table[2, 127]) // 4, int(page_table[2, 255]) // 4]
    assert c128.tolist() == [-1, -1, int(page_table[2, 127]) // 128, int(page_table[2, 255]) // 128]


def test_no_tokens_give_empty_metadata(device, page_table):
    empty = torch.zeros(0, dtype=torch.int64, device=device)
    slots, lens = ops.window_metadata(page_table, empty, empty, window=128)
    assert slots.shape == (0, 128) and lens.shape == (0,)
    assert all(x.shape == (0,) for x in ops.out_locs(page_table, empty, empty))
