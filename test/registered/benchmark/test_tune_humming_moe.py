"""tune_humming_moe's range bookkeeping (no GPU: the timing itself needs one and humming)."""

from sglang.test.repo_scripts import load_script

tune = load_script("sgl-kernel/benchmark/tune_humming_moe.py")


def test_winners_own_the_rows_halfway_to_their_neighbours():
    # T -> rows: 1 -> 6, 2 -> 12, 4 -> 24 (all 256 experts local, top-6)
    results = {1: ("a", 0, 0), 2: ("a", 0, 0), 4: ("b", 0, 0)}
    assert tune.ranges(results, 256) == [[0, 18, "a"], [18, 1 << 30, "b"]]


def test_a_partial_grid_is_spliced_below_its_last_rows():
    old = [[0, 15, "old0"], [15, 240, "old1"], [240, 1 << 30, "old2"]]
    new = [[0, 9, "n1"], [9, 18, "n2"], [18, 1 << 30, "n4"]]
    cut = tune.rows_of(8, 256)  # 48 rows: everything up to T = 8 was retuned
    assert cut == 48
    assert tune.splice(new, old, cut) == [[0, 9, "n1"], [9, 18, "n2"], [18, 48, "n4"], [48, 240, "old1"],
                                          [240, 1 << 30, "old2"]]
    # the spliced list still covers every row once, in order
    spliced = tune.splice(new, old, cut)
    assert spliced[0][0] == 0 and spliced[-1][1] == 1 << 30
    assert all(a[1] == b[0] for a, b in zip(spliced, spliced[1:]))
