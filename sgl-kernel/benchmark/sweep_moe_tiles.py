"""The FP4 MoE's bf16 decode (release numerics) at moe_config's tiles and at alternatives, on an
H200 with CUDA-graph replays and a cold L2 (bench_quant's timing): how moe_config's tier table
was chosen. One rank's 128 experts of Flash's 256 (hidden 4096, inter 2048, top-6, uniformly
random ids; ids >= 128 skipped, as a shard sees them). Each alternative is the default config
with some keys replaced; its output is compared with the default's (rel-err: relative norm,
tiles change only the fp32 summation order).

    python sgl-kernel/benchmark/sweep_moe_tiles.py [T ...] [--out rows.json]
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
    # session 11: 64-row tiles beat 128-row ones at T = 2048 (about 48 rows per expert);
    # session 13 moved the tier there and checks both sides of its edge (2560 / 2816)
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("T", nargs="*", type=int, help=f"token counts (default {sorted(ALTERNATIVES)})")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
