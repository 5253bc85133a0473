"""Tile tables kept as data (configs/*.json, measured per device by the tools in
sgl-kernel/benchmark/, the device named in the file): tiers of tiles by a count M (assignments
for the MoE, tokens for attention), the first tier whose bound >= M wins, the last tier
unbounded (null)."""

import json
from pathlib import Path

CONFIGS = Path(__file__).resolve().parent / "configs"


def load_tiers(path: Path, bound: str = "max_assignments", variant: str = "fp32_tiles") -> tuple:
    """((bound or None, tiles, variant tiles), ...) of a tile file, `bound` naming each tier's
    bound key and `variant` the key of a second set of tiles (fp32 inputs by default), which
    default to the tier's tiles. Raises ValueError unless the bounds increase and only the
    last is null."""
    tiers = tuple((t[bound], t["tiles"], t.get(variant, t["tiles"]))
                  for t in json.loads(Path(path).read_text())["tiers"])
    bounds = [b for b, _, _ in tiers]
    if not bounds or bounds[-1] is not None or None in bounds[:-1] or bounds[:-1] != sorted(set(bounds[:-1])):
        raise ValueError(f"{path}: tier bounds must increase and only the last be null, got {bounds}")
    return tiers


def pick(tiers: tuple, M: int, fp32: bool = False) -> dict:
    """A copy of the tiles of the first tier holding M."""
    for bound, tiles, fp32_tiles in tiers:
        if bound is None or M <= bound:
            return dict(fp32_tiles if fp32 else tiles)
    raise AssertionError("load_tiers guarantees an unbounded last tier")
