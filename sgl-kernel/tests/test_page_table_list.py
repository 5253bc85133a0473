"""PageTableList: per-token lists of compressed-pool slots read through the page table (the
one torch version of entry i = rtt[row, ratio*i + ratio - 1] // ratio)."""

import pytest
import torch

from dsv4_kernels import PageTableList


def _table():
    # row 0: raw slots 100.. ; row 1: an unmapped (-1) position at 7; row 2 unused (-9)
    rtt = torch.full((3, 12), -9, dtype=torch.int32)
    rtt[0] = torch.arange(12, dtype=torch.int32) + 100
    rtt[1] = torch.arange(12, dtype=torch.int32) + 400
    rtt[1, 7] = -1
    return rtt


def test_entries_are_the_slot_of_each_entrys_last_token_over_the_ratio():
    lists = PageTableList(_table(), torch.tensor([0, 1, 0], dtype=torch.int32), ratio=4, width=3)
    got = lists.gather(torch.tensor([3, 3, 1]))
    # entry i reads position 4i+3: row 0 -> 103, 107, 111 -> 25, 26, 27
    assert got.dtype == torch.int32
    assert got.tolist() == [[25, 26, 27], [100, -1, 102], [25, -1, -1]]


def test_slots_at_reads_only_the_given_columns():
    lists = PageTableList(_table(), torch.tensor([1, 0]), ratio=4, width=3)
    assert lists.slots_at(torch.tensor([[2, 0], [1, 1]])).tolist() == [[102, 100], [26, 26]]
    assert lists.slots_at(torch.tensor([0, 2])).tolist() == [[100, 102], [25, 27]]  # [k]: every token


def test_columns_past_the_table_are_clamped_and_slicing_keeps_the_rest():
    lists = PageTableList(_table(), torch.tensor([0, 1, 0]), ratio=128, width=2)
    # ratio 128 entries lie past a 12-column table: clamped to its last column, never read
    # within a length; the gathered list masks them
    assert lists.gather(torch.tensor([0, 0, 0])).tolist() == [[-1, -1]] * 3
    part = lists[1:]
    assert part.num_tokens == 2 and part.width == 2 and part.ratio == 128 and part.rtt is lists.rtt
    assert part.rows.tolist() == [1, 0]
    # a slice of every token is the list itself (no rebuild); any other slice is a new one
    assert lists[0:3] is lists and lists[:] is lists and lists[0:10] is lists
    assert lists[0:2] is not lists and lists[::2].rows.tolist() == [0, 0]


@pytest.mark.parametrize("kw, match", [
    (dict(rtt=torch.zeros(4, dtype=torch.int32)), "2-D page table"),
    (dict(rows=torch.zeros(2, 2, dtype=torch.int32)), "1-D rows"),
    (dict(rtt=torch.zeros(2, 8)), "integer rtt"),
    (dict(ratio=0), "ratio >= 1"),
    (dict(width=-1), "width >= 0"),
])
def test_bad_arguments_are_named(kw, match):
    args = dict(rtt=torch.zeros(2, 8, dtype=torch.int32), rows=torch.zeros(3, dtype=torch.int32), ratio=4, width=2)
    with pytest.raises(ValueError, match=match):
        PageTableList(**{**args, **kw})
    with pytest.raises(TypeError, match="sliced by tokens"):
        PageTableList(**args)[0]
