"""Compressor pooling (fp32 state rows) and ring update at D=512, replayed from a CUDA graph.
Bytes = gathered kv + score rows read + pooled written (+ fresh rows copied for the update)."""

import torch

from common import report, require_cuda, time_ms

D, SLOTS = 512, 256


def main():
    if not require_cuda():
        return
    from dsv4_kernels import ops

    print(f"== compressor (D={D}, fp32 state)")
    for ratio in (4, 128):
        coff = 2 if ratio == 4 else 1
        R = coff * ratio
        kv_state = torch.randn(SLOTS, R, coff * D, device="cuda")
        score_state = torch.randn_like(kv_state)
        for T in (256, 4096):
            kv_new = torch.randn(T, coff * D, device="cuda")
            score_new = torch.randn_like(kv_new)
            E = max(1, T // ratio)
            gather_idx = torch.randint(0, SLOTS * R, (E, R), device="cuda", dtype=torch.int32)
            out = torch.empty(E, D, device="cuda")
            ms = time_ms(lambda: ops.compressor_pool(kv_state, score_state, kv_new, score_new,
                                                     gather_idx, ratio, out), graph=True)
            report(f"compressor_pool r={ratio} T={T} E={E}", ms, nbytes=E * R * D * 4 * 2 + out.numel() * 4)
            loc = torch.randperm(SLOTS * R, device="cuda")[:T].int() if T <= SLOTS * R else \
                torch.randint(0, SLOTS * R, (T,), device="cuda", dtype=torch.int32)
            ms = time_ms(lambda: ops.compressor_state_update(kv_state, score_state, kv_new,
                                                             score_new, loc), graph=True)
            report(f"compressor_state_update r={ratio} T={T}", ms, nbytes=4 * kv_new.numel() * 4)


if __name__ == "__main__":
    main()
