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


def _cfg(name, height):
    return {"name": name, "block_shape": [height, 256, 128]}


def test_a_pair_sharing_one_block_height_wins_when_its_saved_alignment_pays():
    # T = 1: the fastest down GEMM has 16-row blocks, the fastest gate/up 8-row ones; a second
    # alignment (3 us) costs more than the down GEMM's 8-row candidate loses (1 us)
    g8, d16, d8 = _cfg("g8", 8), _cfg("d16", 16), _cfg("d8", 8)
    w13 = {1: ({"g8": (0.0284, g8)}, "g8")}
    w2 = {1: ({"d16": (0.0169, d16), "d8": (0.0179, d8)}, "d8")}
    align = {1: {8: 0.003, 16: 0.003}}
    c13, c2, ms, current = tune.pick_pairs(w13, w2, align)[1]
    assert (c13["name"], c2["name"]) == ("g8", "d8")
    assert abs(ms - (0.0284 + 0.0179 + 0.003)) < 1e-12 and current == ms
    # a down GEMM 4 us faster at 16 rows is worth the second alignment
    w2[1][0]["d16"] = (0.0139, d16)
    c13, c2, ms, _ = tune.pick_pairs(w13, w2, align)[1]
    assert c2["name"] == "d16" and abs(ms - (0.0284 + 0.0139 + 0.006)) < 1e-12


def test_pairs_become_each_gemms_ranges_with_the_same_edges():
    a8, b16, c8 = _cfg("a8", 8), _cfg("b16", 16), _cfg("c8", 8)
    w13 = {1: ({"a8": (1.0, a8)}, "a8"), 2: ({"a8": (1.0, a8)}, "a8")}
    w2 = {1: ({"b16": (1.0, b16), "c8": (1.5, c8)}, "c8"), 2: ({"b16": (0.1, b16), "c8": (1.5, c8)}, "c8")}
    align = {1: {8: 1.0, 16: 1.0}, 2: {8: 1.0, 16: 1.0}}
    pairs = tune.pick_pairs(w13, w2, align)
    gate = tune.ranges({T: (p[0],) for T, p in pairs.items()}, 256)
    down = tune.ranges({T: (p[1],) for T, p in pairs.items()}, 256)
    assert [c["name"] for *_, c in gate] == ["a8"] and [c["name"] for *_, c in down] == ["c8", "b16"]
    assert down[0][1] == 9  # halfway between T = 1 (6 rows) and T = 2 (12): the gate/up list's edges too
    assert tune.block_height(a8) == 8
