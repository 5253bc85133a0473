"""The tile tables kept as data (dsv4_kernels/configs/): every file loads with increasing bounds
and an unbounded last tier, names the device it was measured on, and the kernels pick from them
the tiles the H200 measured fastest."""

import json

import pytest

from dsv4_kernels import fp4_gemv_moe, fp4_moe, sparse_attention, tile_tables

FILES = {"fp4_moe_tiles.json": "max_assignments", "fp4_gemv_moe_tiles.json": "max_assignments",
         "sparse_attention_tiles.json": "max_tokens"}


@pytest.mark.parametrize("name", sorted(FILES))
def test_every_tile_file_loads_and_names_its_device(name):
    path = tile_tables.CONFIGS / name
    tiers = tile_tables.load_tiers(path, FILES[name])
    assert tiers[-1][0] is None and len(tiers) >= 3
    assert json.loads(path.read_text())["device"] == "NVIDIA H200"


def test_files_that_break_the_tier_rules_are_refused(tmp_path):
    for bounds in ([8, None, 16], [16, 8, None], [8, 16], [8, 8, None]):
        path = tmp_path / "tiles.json"
        path.write_text(json.dumps({"tiers": [{"max_assignments": b, "tiles": {"block_m": 16}} for b in bounds]}))
        with pytest.raises(ValueError, match="tier bounds"):
            tile_tables.load_tiers(path)


def test_pick_takes_the_first_tier_holding_m_and_copies_it():
    tiers = ((4, {"a": 1}, {"a": 2}), (None, {"a": 3}, {"a": 3}))
    assert [tile_tables.pick(tiers, m)["a"] for m in (1, 4, 5, 10**9)] == [1, 1, 3, 3]
    assert tile_tables.pick(tiers, 4, fp32=True) == {"a": 2}
    tile_tables.pick(tiers, 1)["a"] = 99
    assert tiers[0][1] == {"a": 1}


def test_sparse_attention_takes_the_measured_tiers():
    S = sparse_attention.SparseAttnConfig
    got = [sparse_attention.measured_config(T) for T in (1, 15, 16, 255, 256, 65536)]
    assert got == [S(block_h=32), S(block_h=32), S(block_h=64), S(block_h=64),
                   S(block_h=64, keys_as_m=True), S(block_h=64, keys_as_m=True)]
    assert sparse_attention.measured_config(8) is sparse_attention.measured_config(9)  # built once
    # an FP8 KV cache: tiles of its own in every tier (the dequantized rows need registers)
    fp8 = [sparse_attention.measured_config(T, kv_fp8=True) for T in (1, 15, 16, 255, 256, 65536)]
    assert fp8 == [S(block_h=16, block_n=16), S(block_h=16, block_n=16), S(block_h=32), S(block_h=32),
                   S(block_h=64, block_n=16, keys_as_m=True), S(block_h=64, block_n=16, keys_as_m=True)]


def test_the_moe_variants_read_their_files():
    assert fp4_moe.TILES_FILE.parent == fp4_gemv_moe.TILES_FILE.parent == tile_tables.CONFIGS
    assert fp4_gemv_moe.gemv_config(64, 6) == dict(block_m=2, block_n_up=16, block_n_down=32, chunks=16,
                                                   num_warps=8, num_stages=2)
    assert fp4_moe.moe_config(1, 6) == dict(block_m=16, block_n_up=16, block_n_down=32, num_warps=2, num_stages=4)
