"""sgl-kernel/benchmark/sweep_moe_tiles.py --write-config: a sweep's winners become a tile file
in configs/fp4_moe_tiles.json's format that fp4_moe's loader reads back."""

import json
import sys

from dsv4_kernels import fp4_moe, tile_tables
from sglang.test.repo_scripts import REPO, load_script

BENCH = REPO / "sgl-kernel" / "benchmark"
sys.path.insert(0, str(BENCH))
sweep = load_script("sgl-kernel/benchmark/sweep_moe_tiles.py")

A = dict(block_m=16, block_n_up=64, block_n_down=64, num_warps=4, num_stages=4, step_dot=True)
B = dict(block_m=64, block_n_up=64, block_n_down=128, num_warps=4, num_stages=3, step_dot=True)
C = dict(block_m=128, block_n_up=128, block_n_down=256, num_warps=8, num_stages=3, step_dot=True)


def test_winners_merge_into_tiers_below_the_current_small_tiers(tmp_path):
    rows = [dict(T=64, config=A, ms=1.0), dict(T=64, config=B, ms=2.0),
            dict(T=256, config=A, ms=1.3), dict(T=256, config=B, ms=2.5),
            dict(T=1024, config=B, ms=1.9), dict(T=1024, config=A, ms=2.4),
            dict(T=4096, config=B, ms=5.0), dict(T=4096, config=C, ms=3.3)]
    data = sweep.write_config(str(tmp_path / "tiles.json"), rows, fp4_moe.TILES_FILE, "NVIDIA H200")
    current = json.loads(fp4_moe.TILES_FILE.read_text())
    # the current tiers below T = 64's 384 assignments stay; A wins 64 and 256, B 1024, C 4096
    assert [t["max_assignments"] for t in data["tiers"]] == [96, 256 * 6, 1024 * 6, None]
    assert data["tiers"][0] == current["tiers"][0]
    assert [t["tiles"] for t in data["tiers"][1:]] == [A, B, C]
    # the unbounded tier keeps the current file's fp32 tiles; the others had none to keep
    assert data["tiers"][-1]["fp32_tiles"] == current["tiers"][-1]["fp32_tiles"]
    assert "fp32_tiles" not in data["tiers"][2]
    assert data["device"] == "NVIDIA H200" and data["about"] == current["about"]
    tiers = tile_tables.load_tiers(tmp_path / "tiles.json")
    assert [tile_tables.pick(tiers, T * 6)["block_m"] for T in (16, 17, 256, 257, 1024, 1025)] == \
        [16, 16, 16, 64, 64, 128]
