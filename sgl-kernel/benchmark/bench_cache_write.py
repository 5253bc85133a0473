"""RMSNorm + RoPE + KV-cache write, q RMS + RoPE, and inverse RoPE at D=512, rope 64
(replayed from a CUDA graph, as in the model). Bytes = rows read + rows written."""

import torch

from common import report, require_cuda, time_ms

D, ROPE, H = 512, 64, 64


def main():
    if not require_cuda():
        return
    from dsv4_kernels import ops
    from dsv4_kernels.kv_fp8 import FP8KVLayout

    cos = torch.randn(65536, ROPE // 2, device="cuda")
    sin = torch.randn(65536, ROPE // 2, device="cuda")
    weight = torch.rand(D, device="cuda")
    pool = torch.empty(1 << 17, D, device="cuda", dtype=torch.bfloat16)
    pool8 = torch.empty(1 << 17, FP8KVLayout(D, ROPE).row_bytes, device="cuda", dtype=torch.uint8)
    print(f"== cache write / rope (D={D}, rope_dim={ROPE}, H={H})")
    for T in (64, 1024, 8192):
        positions = torch.randint(0, 65536, (T,), device="cuda")
        kv = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
        kv_out = torch.empty_like(kv)
        loc = torch.randperm(pool.shape[0], device="cuda")[:T].int()
        ms = time_ms(lambda: ops.rmsnorm_rope_store(kv, weight, 1e-6, cos, sin, positions, ROPE,
                                                    pool, loc, kv_out), graph=True)
        report(f"rmsnorm_rope_store T={T}", ms, nbytes=3 * kv.numel() * 2)
        ms = time_ms(lambda: ops.rmsnorm_rope_store(kv, weight, 1e-6, cos, sin, positions, ROPE,
                                                    pool8, loc), graph=True)
        report(f"rmsnorm_rope_store T={T} fp8 kv cache", ms, nbytes=T * (D * 2 + pool8.shape[1]))
        q = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16)
        ms = time_ms(lambda: ops.q_rms_rope(q, cos, sin, positions, ROPE, 1e-6), graph=True)
        report(f"q_rms_rope T={T}", ms, nbytes=2 * q.numel() * 2)
        ms = time_ms(lambda: ops.inverse_rope_(q, cos, sin, positions, ROPE), graph=True)
        report(f"inverse_rope_ T={T}", ms, nbytes=2 * q.numel() * 2)


if __name__ == "__main__":
    main()
