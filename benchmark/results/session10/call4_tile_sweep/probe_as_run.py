"""Session 10 probe (not committed): FP4 MoE bf16 variant, tile/pipeline sweep, 128-expert shard."""
import sys, json
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sgl-kernel" / "benchmark"))
from bench_quant import fp4_expert_weights, _time, MOE_D, MOE_E, MOE_TOPK
from dsv4_kernels import fp4_moe

w = fp4_expert_weights()
ws = tuple(t[: MOE_E // 2] for t in w)
B16 = dict(block_m=16, block_n_up=64, block_n_down=64, num_warps=4, num_stages=4)
SWEEP = {
    64: [dict(num_stages=3, block_n_up=32, block_n_down=32, num_warps=2)],
    256: [B16, dict(B16, num_stages=3), dict(B16, block_n_up=128, block_n_down=128),
          dict(B16, block_n_up=32, block_n_down=32, num_warps=2)],
    512: [B16, dict(block_m=32, num_warps=4), dict(num_warps=4)],
    1024: [B16, dict(block_m=32, num_warps=4), dict(num_warps=4), dict(num_warps=4, block_n_up=128)],
    2048: [B16, dict(block_m=32, num_warps=4), dict(num_warps=4), dict(block_n_up=128),
           dict(block_n_up=128, num_warps=4)],
    4096: [dict(block_n_up=128, num_stages=4), dict(block_n_up=128, block_m=64, num_warps=4),
           dict(block_n_up=128, block_n_down=256)],
}
rows = []
for T in [int(t) for t in sys.argv[1:]] or list(SWEEP):
    torch.manual_seed(T)
    x = torch.randn(T, MOE_D, device="cuda").bfloat16()
    ids = torch.rand(T, MOE_E, device="cuda").argsort(dim=1)[:, :MOE_TOPK].int()
    weights = torch.rand(T, MOE_TOPK, device="cuda")
    base = fp4_moe.moe_config(T, MOE_TOPK)
    ref = None
    for alt in [{}] + SWEEP.get(T, []):
        cfg = dict(base, **alt)
        out = torch.empty(T, MOE_D, device="cuda")
        fn = lambda out=out, c=cfg: fp4_moe.fp4_fused_moe(x, *ws, ids, weights, 10.0, out, True, "bf16", config=c)
        try:
            fn(); torch.cuda.synchronize()
            t = _time(fn)
        except Exception as e:  # a config that does not compile or fit
            print(f"T={T} {alt}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        if ref is None:
            ref = out.clone()
        err = ((out - ref).norm() / ref.norm()).item()
        rows.append(dict(T=T, alt=alt, ms=t, rel_err=err))
        print(f"T={T:<5} {json.dumps(alt):<70} median {t[0]:.4f} ms  p10 {t[1]:.4f}  p90 {t[2]:.4f}  rel-err {err:.1e}", flush=True)
print(json.dumps(rows))
