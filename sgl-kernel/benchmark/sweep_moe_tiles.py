"""The FP4 MoE's bf16 decode (release numerics) at moe_config's tiles and at alternatives, on an
H200 with CUDA-graph replays and a cold L2 (bench_quant's timing): how moe_config's tier table
was chosen. One rank's 128 experts of Flash's 256 (hidden 4096, inter 2048, top-6, uniformly
random ids; ids >= 128 skipped, as a shard sees them). Each alternative is the default config
with some keys replaced; its output is compared with the default's (rel-err: relative norm,
tiles change only the fp32 summation order).

--write-config FILE writes the winners in the format of dsv4_kernels/configs/fp4_moe_tiles.json
(read by fp4_moe.moe_config): consecutive token counts won by the same tiles form one tier,
bounded by the assignments (T x top-k) of its last token count; tiers below the smallest token
count swept, and fp32_tiles, are kept from the current file. Review it, then copy it over the
current file. The `moe-tiles` suite (benchmark/suites.toml) runs this.

    python sgl-kernel/benchmark/sweep_moe_tiles.py [T ...] [--out rows.json] [--write-config tiles.json]
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_quant import MOE_D, MOE_E, MOE_TOPK, _time, fp4_expert_weights  # noqa: E402

B16 = dict(block_m=16, block_n_up=64, block_n_down=64, num_warps=4, num_stages=4)
ALTERNATIVES = {  # T -> tile changes tried beside moe_config(T)'s own
    64: [dict(num_stages=3), dict(num_stages=5), dict(num_warps=2), dict(num_warps=8),
         dict(block_n_up=32, block_n_down=32), dict(block_n_up=128, block_n_down=128)],
    256: [dict(B16, num_stages=3), dict(B16, block_n_up=128, block_n_down=128),
          dict(block_m=32, block_n_down=128, num_stages=3), dict(block_m=64, num_warps=8, num_stages=3)],
    512: [dict(block_m=32, block_n_down=128, num_stages=3), dict(block_m=64, num_warps=8, num_stages=3)],
    1024: [B16, dict(block_m=64, num_warps=8), dict(block_m=64, num_warps=4)],
    # 64-row against 128-row tiles around the tier edge (about 48 rows per expert at 2048)
    1536: [dict(num_warps=8), dict(block_m=128, block_n_up=128, num_warps=8)],
    2048: [dict(num_warps=8), dict(block_n_down=64), dict(block_n_up=128),
           dict(block_m=128, block_n_up=128, num_warps=8)],
    2560: [dict(block_m=128, block_n_up=128, block_n_down=256, num_warps=8)],
    2816: [dict(block_m=64, block_n_up=64, block_n_down=128, num_warps=4)],
    3072: [dict(block_m=64, block_n_up=64), dict(block_m=64, block_n_up=64, num_warps=4)],
    4096: [dict(block_m=64, block_n_up=64), dict(block_m=64, block_n_up=64, block_n_down=256),
           dict(block_m=64, block_n_up=128, block_n_down=256)],
    8192: [dict(block_m=64, block_n_up=64), dict(block_m=64, block_n_up=128, block_n_down=256)],
}


def tiers_from_rows(rows: list[dict], current: dict, topk: int = MOE_TOPK) -> list[dict]:
    """The tile tiers of a sweep's rows (each {"T", "config", "ms"}): per T the fastest config,
    consecutive T won by the same config merged, each tier bounded by its last T x topk and the
    last one unbounded. `current` is the present file's data: its tiers below the first swept
    T's assignments come first, and each new tier keeps the fp32_tiles of the current tier that
    held its bound."""
    best = {}
    for row in rows:
        if row["T"] not in best or row["ms"] < best[row["T"]]["ms"]:
            best[row["T"]] = row
    if not best:
        raise ValueError("tiers_from_rows: no rows")
    first_m = min(best) * topk
    tiers = [dict(t) for t in current["tiers"] if t["max_assignments"] is not None
             and t["max_assignments"] < first_m]

    def fp32_for(m):
        for t in current["tiers"]:
            if t["max_assignments"] is None or m <= t["max_assignments"]:
                return t.get("fp32_tiles")
        return None

    for T in sorted(best):
        tiles = best[T]["config"]
        if len(tiers) > 0 and tiers[-1]["tiles"] == tiles and tiers[-1]["max_assignments"] >= first_m:
            tiers[-1]["max_assignments"] = T * topk
        else:
            tiers.append({"max_assignments": T * topk, "tiles": dict(tiles)})
    tiers[-1]["max_assignments"] = None
    for t in tiers:
        fp32 = fp32_for(t["max_assignments"] if t["max_assignments"] is not None else 1 << 62)
        if fp32 is not None and "fp32_tiles" not in t:
            t["fp32_tiles"] = dict(fp32)
    return tiers


def write_config(path: str, rows: list[dict], current_path: Path, device: str) -> dict:
    current = json.loads(Path(current_path).read_text())
    data = dict(current, device=device, tiers=tiers_from_rows(rows, current))
    Path(path).write_text(json.dumps(data, indent=1) + "\n")
    return data


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("T", nargs="*", type=int, help=f"token counts (default {sorted(ALTERNATIVES)})")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--write-config", default=None, help="write the winners as a tile file here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("sweep_moe_tiles: needs a CUDA GPU")
        return 1
    from dsv4_kernels import fp4_moe

    ws = tuple(t[: MOE_E // 2] for t in fp4_expert_weights())
    rows = []
    for T in args.T or sorted(ALTERNATIVES):
        torch.manual_seed(T)
        x = torch.randn(T, MOE_D, device="cuda").bfloat16()
        ids = torch.rand(T, MOE_E, device="cuda").argsort(dim=1)[:, :MOE_TOPK].int()
        weights = torch.rand(T, MOE_TOPK, device="cuda")
        base = fp4_moe.moe_config(T, MOE_TOPK)
        ref = None
        for change in [{}] + ALTERNATIVES.get(T, []):
            cfg = dict(base, **change)
            out = torch.empty(T, MOE_D, device="cuda")

            def run(out=out, cfg=cfg):
                return fp4_moe.fp4_fused_moe(x, *ws, ids, weights, 10.0, out, True, "bf16", config=cfg)

            try:
                run()
                torch.cuda.synchronize()
                median, p10, p90 = _time(run)
            except Exception as e:  # noqa: BLE001 - a tile that does not compile or fit is a result
                print(f"T={T:<5} {json.dumps(change):<64} {type(e).__name__}: {str(e)[:160]}", flush=True)
                continue
            ref = out.clone() if ref is None else ref
            err = ((out - ref).norm() / ref.norm()).item()
            rows.append(dict(T=T, config=cfg, change=change, ms=median, p10=p10, p90=p90, rel_err=err))
            label = json.dumps(change) if change else f"moe_config {json.dumps(base)}"
            print(f"T={T:<5} {label:<64} {median:8.4f} ms [{p10:.4f}-{p90:.4f}]  rel-err {err:.1e}",
                  flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    if args.write_config:
        write_config(args.write_config, rows, fp4_moe.TILES_FILE, torch.cuda.get_device_name())
    return 0


if __name__ == "__main__":
    sys.exit(main())
