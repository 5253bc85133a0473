"""Release-format kernels on one GPU (built and tuned on an H200), replayed from CUDA graphs with a cold L2:

- FP8 block-scaled linear (ops.fp8_block_linear, act_quant on = release numerics, off =
  weight-only) at DSV4-Flash shapes, with bf16 torch.mm on a bf16 copy of the weight beside it.
  fp8_release is the Triton kernel (backend="triton"); cublas_block the same release numerics
  through cuBLAS block scaling (backend="cublas", fp8_scaled_mm: what "auto" runs where the
  device passed its probe; skipped with the reason elsewhere).
  TFLOP/s vs the dense FP8 (1979) and bf16 (989) peaks; GB/s (weight + scales + x + out) vs
  the GPU's HBM peak (common.hbm_gbps: 4.8 TB/s on an H200).
- FP4 MoE (fp4_moe.fp4_fused_moe, both variants; the bf16 one beside its other K step:
  bf16_release_step = one dot per 128-input step where moe_config runs one per 32-input chunk,
  bf16_release_chunk = the reverse where moe_config's tiles already step, and there
  bf16_release_bitdecode = the step's decode by _e2m1_scaled instead of the pair decode; the gemv one at
  T <= GEMV_MAX_T, with tile
  alternatives where they differ from gemv_config's: gemv_release_bm1 / _bm4 = 1 / 4 rows
  per expert block, _narrow / _wide = the small-batch (16/32 x 512) / larger-batch
  (64 x 128) N x K tiles) at Flash's expert dims (hidden 4096, inter
  2048, top-6 of 256, uniformly random ids): one rank's 128 experts (ids >= 128 skipped, as a
  shard sees them) and all 256. GB/s counts the weight bytes actually touched (distinct local
  experts hit x bytes per expert, scales included); TFLOP/s counts the local assignments'
  three GEMMs. The MoE backends side by side (humming beside this kernel): bench_moe_backends.py.

Every configuration is run once (compiled) before any is timed; each time is the median of
REPS graph replays, with the 10th-90th percentile spread.

    python sgl-kernel/benchmark/bench_quant.py --out quant.json [--quick]
    python sgl-kernel/benchmark/bench_quant.py --compile-report   # sm_90 compile, no GPU
    python sgl-kernel/benchmark/bench_quant.py --only moe --quick --moe-t 1 16 64  # decode
    python sgl-kernel/benchmark/bench_quant.py --only moe --quick --moe-t 2048 4096 8192  # large
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import _flush_l2, hbm_gbps, require_cuda  # noqa: E402

FP8_PEAK_TFLOPS = 1979.0
BF16_PEAK_TFLOPS = 989.0
REPS = 20

# (name, K, N) of Flash's FP8 linears (x [M, K] -> [M, N]).
GEMM_SHAPES = [("wq_a", 4096, 1024), ("wq_b", 1024, 64 * 512), ("wkv", 4096, 512),
               ("wo_b", 8192, 4096), ("shared_w1_w3", 4096, 2048), ("shared_w2", 2048, 4096)]
GEMM_M = [16, 64, 256, 1024, 2048, 4096, 8192]
QUICK_SIZES = [16, 64, 2048, 8192]  # --quick: M and T
# --quick also times 128 x 128 x 8-warp FP8 tiles beside gemm_config's at M >= 2048
# (fp8_release_128x128: one CTA per SM; the 64 x 128 default lets two CTAs share an SM), and fp8_release_tma: the same GEMM with TMA tile loads
# (fp8_tma_experiment.py), when it runs and agrees.
ALT_LARGE_TILE = dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=4)
MOE_D, MOE_I, MOE_E, MOE_TOPK = 4096, 2048, 256, 6
MOE_T = [1, 16, 64, 256, 1024, 4096, 8192]
GEMV_MAX_T = 256  # the gemv decode is for decode-sized batches: not timed beyond


def _graph(fn):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def _time(fn, reps: int = REPS):
    """(median, p10, p90) ms of graph replays of fn, L2 flushed before each."""
    g = _graph(fn)
    g.replay()
    times = []
    for _ in range(reps):
        _flush_l2()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return statistics.median(times), times[len(times) // 10], times[(len(times) * 9) // 10]


def _record(rows, kind, name, size, impl, timing, nbytes, flops, **extra):
    ms, p10, p90 = timing
    tflops = flops / ms / 1e9
    gbps = nbytes / ms / 1e6
    row = dict(kind=kind, name=name, size=size, impl=impl, ms=ms, ms_p10=p10, ms_p90=p90,
               tflops=tflops, pct_fp8_peak=100 * tflops / FP8_PEAK_TFLOPS,
               pct_bf16_peak=100 * tflops / BF16_PEAK_TFLOPS, gbps=gbps,
               pct_hbm=100 * gbps / hbm_gbps(), bytes=nbytes, flops=flops, **extra)
    rows.append(row)
    print(f"{kind:<5} {name:<13} {size:>5} {impl:<16} {ms * 1e3:9.1f} us "
          f"[{p10 * 1e3:8.1f}-{p90 * 1e3:8.1f}]  {tflops:7.1f} TFLOP/s "
          f"({row['pct_fp8_peak']:5.1f}% fp8, {row['pct_bf16_peak']:5.1f}% bf16)  "
          f"{gbps:7.0f} GB/s ({row['pct_hbm']:5.1f}% HBM)", flush=True)


def bench_gemm(rows, ms_list, alt_tile=False):
    from dsv4_kernels import fp8_gemm, ops
    from dsv4_kernels import quant_reference as Q

    cases = []
    for name, K, N in GEMM_SHAPES:
        q, s = Q.quantize_fp8_weight(torch.randn(N, K, device="cuda") / K ** 0.5)
        wb = Q.dequantize_fp8_block(q, s).bfloat16()
        for M in ms_list:
            x = torch.randn(M, K, device="cuda").bfloat16()
            fp8_bytes = N * K + s.numel() * 4 + M * K * 2 + M * N * 2
            bf16_bytes = N * K * 2 + M * K * 2 + M * N * 2
            flops = 2 * M * N * K
            for impl, fn, nbytes in (
                ("fp8_release",
                 lambda x=x, q=q, s=s: ops.fp8_block_linear(x, q, s, True, backend="triton"),
                 fp8_bytes),
                ("fp8_weight_only", lambda x=x, q=q, s=s: ops.fp8_block_linear(x, q, s, False),
                 fp8_bytes),
                ("bf16_torch_mm", lambda x=x, wb=wb: torch.mm(x, wb.t()), bf16_bytes),
            ):
                cases.append((name, M, impl, fn, nbytes, flops))
            cublas = _cublas_case(x, q, s)
            if cublas is not None:
                cases.append((name, M, "cublas_block", cublas, fp8_bytes, flops))
            if alt_tile and M >= 2048:
                alt = dict(fp8_gemm.gemm_config(M, N, K, True), **ALT_LARGE_TILE)
                cases.append((name, M, "fp8_release_128x128",
                              lambda x=x, q=q, s=s, c=alt: fp8_gemm.fp8_block_linear(x, q, s,
                                                                                    True, c),
                              fp8_bytes, flops))
                tma = _tma_case(x, q, s)
                if tma is not None:
                    cases.append((name, M, "fp8_release_tma", tma, fp8_bytes, flops))
    for case in cases:  # compile and warm every config before timing any
        case[3]()
    torch.cuda.synchronize()
    for name, M, impl, fn, nbytes, flops in cases:
        _record(rows, "gemm", name, M, impl, _time(fn), nbytes, flops)


def _cublas_case(x, q, s):
    """ops.fp8_block_linear forced onto cuBLAS, with its scale layout built once (as
    Fp8BlockLinear keeps it), or None with the reason printed."""
    from dsv4_kernels import fp8_scaled_mm, ops
    try:
        ops.fp8_block_linear(x, q, s, True, backend="cublas")
    except ValueError as exc:
        print(f"cublas_block M={x.shape[0]} skipped: {exc}", flush=True)
        return None
    layout = fp8_scaled_mm.weight_scale_layout(s)
    return lambda: ops.fp8_block_linear(x, q, s, True, backend="cublas", cublas_scale=layout)


def _tma_case(x, q, s):
    """fp8_tma_experiment's GEMM on these operands if it runs and agrees with
    ops.fp8_block_linear (within the tests' bf16 tolerance), else None with the reason."""
    from dsv4_kernels import ops
    try:
        from fp8_tma_experiment import fp8_linear_tma
        got = fp8_linear_tma(x, q, s)
        torch.testing.assert_close(got.float(), ops.fp8_block_linear(x, q, s, True).float(),
                                   rtol=2 ** -7, atol=1e-3)
    except Exception as exc:  # an experiment: report it, keep benchmarking the rest
        print(f"fp8_release_tma M={x.shape[0]} skipped: {type(exc).__name__}: "
              f"{str(exc).splitlines()[0] if str(exc) else ''}", flush=True)
        return None
    return lambda: fp8_linear_tma(x, q, s)


# Packed e2m1 codes plus e8m0 scales of one expert's W1, W3 and W2 at Flash's dims.
MOE_EXPERT_BYTES = 3 * (MOE_I * MOE_D // 2 + MOE_I * MOE_D // 32)


def fp4_expert_weights(n: int = MOE_E, generator=None):
    """n routed experts at Flash's dims on the GPU, release format: (w1, s1, w3, s3, w2, s2),
    random N(0, 1/in) weights quantized 32 experts at a time (a whole fp32 stack would be
    6+ GB)."""
    from dsv4_kernels import quant_reference as Q

    def stack(o, i):
        packed = torch.empty(n, o, i // 2, dtype=torch.int8, device="cuda")
        scale = torch.empty(n, o, i // 32, dtype=torch.uint8, device="cuda")
        for e in range(0, n, 32):
            k = min(32, n - e)
            w = torch.randn(k, o, i, device="cuda", generator=generator) * i ** -0.5
            packed[e:e + k], scale[e:e + k] = Q.quantize_fp4(w)
        return packed, scale

    w1, s1 = stack(MOE_I, MOE_D)
    w3, s3 = stack(MOE_I, MOE_D)
    w2, s2 = stack(MOE_D, MOE_I)
    return w1, s1, w3, s3, w2, s2


def bench_moe(rows, t_list, locals_=(MOE_E // 2, MOE_E)):
    from dsv4_kernels import fp4_gemv_moe, fp4_moe

    w1, s1, w3, s3, w2, s2 = fp4_expert_weights()
    expert_bytes = MOE_EXPERT_BYTES
    cases = []
    for e_local in locals_:
        ws = tuple(t[:e_local] for t in (w1, s1, w3, s3, w2, s2))
        for T in t_list:
            x = torch.randn(T, MOE_D, device="cuda").bfloat16()
            ids = torch.rand(T, MOE_E, device="cuda").argsort(dim=1)[:, :MOE_TOPK].int()
            weights = torch.rand(T, MOE_TOPK, device="cuda")
            out = torch.empty(T, MOE_D, device="cuda")
            local = ids < e_local
            hit = ids[local].unique().numel()
            n_assign = int(local.sum())
            nbytes = hit * expert_bytes
            flops = 2 * n_assign * 3 * MOE_D * MOE_I
            cfg = fp4_moe.moe_config(T, MOE_TOPK)
            other_step = (dict(cfg, step_dot=False), "_chunk") if cfg.get("step_dot") else \
                (dict(cfg, step_dot=True), "_step")
            runs = [("bf16", True, None, ""), ("bf16", False, None, ""), ("bf16", True, *other_step)]
            if cfg.get("step_dot"):
                runs.append(("bf16", True, dict(cfg, pair_decode=False), "_bitdecode"))
            if T <= GEMV_MAX_T:
                gemv = fp4_gemv_moe.gemv_config(T, MOE_TOPK)
                alts = [(dict(gemv, block_m=1), "_bm1"), (dict(gemv, block_m=4), "_bm4"),
                        (dict(gemv, block_n_up=16, block_n_down=32, chunks=16), "_narrow"),
                        (dict(gemv, block_n_up=64, block_n_down=64, chunks=4), "_wide")]
                runs += [("gemv", True, None, ""), ("gemv", False, None, "")]
                runs += [("gemv", True, c, tag) for c, tag in alts if c != gemv]
            for variant, act_quant, cfg, tag in runs:
                impl = f"{variant}_{'release' if act_quant else 'weight_only'}{tag}"
                fn = (lambda x=x, ws=ws, ids=ids, weights=weights, out=out, v=variant,
                      a=act_quant, c=cfg: fp4_moe.fp4_fused_moe(x, *ws, ids, weights, 10.0, out,
                                                                a, v, config=c))
                cases.append((f"moe_E{e_local}", T, impl, fn, nbytes, flops, hit))
    for case in cases:
        case[3]()
    torch.cuda.synchronize()
    for name, T, impl, fn, nbytes, flops, hit in cases:
        _record(rows, "moe", name, T, impl, _time(fn), nbytes, flops, experts_hit=hit)
    for name in sorted({c[0] for c in cases}):  # release numerics: which decode won, by T
        for T in t_list:
            ms = {r["impl"]: r["ms"] for r in rows
                  if r["kind"] == "moe" and r["name"] == name and r["size"] == T}
            won = min((v for v in fp4_moe.VARIANTS if f"{v}_release" in ms),
                      key=lambda v: ms[f"{v}_release"])
            print(f"variant {name} T={T:<5} faster: {won:<4}  default_variant picks: "
                  f"{fp4_moe.default_variant(T, MOE_TOPK)}", flush=True)


def _sm90_report(name, fn, types, constexprs, num_warps, num_stages, not_aligned=()):
    """Compile fn for sm_90 without a GPU (Triton's bundled ptxas) and print registers, spill
    stack, shared memory and the MMA kind. Pointers and int args other than `not_aligned` get
    the 16-divisibility the launcher would specialize on (without it nothing is pipelined)."""
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {a: "constexpr" if a in constexprs else types.get(a, "i32") for a in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
             if sig[a] != "constexpr" and (sig[a].startswith("*") or
                                           (sig[a] == "i32" and a not in not_aligned))}
    kernel = triton.compile(ASTSource(fn, sig, constexprs, attrs),
                            target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=num_warps, num_stages=num_stages))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        tool = Path(triton.__path__[0]) / "backends" / "nvidia" / "bin" / "cuobjdump"
        usage = subprocess.run([str(tool), "--dump-resource-usage", f.name],
                               capture_output=True, text=True).stdout
    fields = dict(tok.split(":", 1) for line in usage.splitlines() if "REG:" in line
                  for tok in line.split() if ":" in tok)
    ptx = kernel.asm["ptx"]
    mma = "wgmma" if "wgmma" in ptx else "mma.sync" if "mma.sync" in ptx else "-"
    print(f"{name:<46} regs {fields.get('REG', '?'):>4}  spill-stack {fields.get('STACK', '?'):>5}"
          f"  smem {kernel.metadata.shared:>7}  mma {mma}", flush=True)


def compile_report(only=None):
    """Every kernel of bench_quant at each config the shape tables pick, compiled for sm_90
    (only: "gemm" or "moe" for one half)."""
    from dsv4_kernels import fp8_act_quant
    from dsv4_kernels import fp8_gemm as G

    if only == "moe":
        return _moe_compile_report()
    _sm90_report("act_quant (8 blocks of 128)", fp8_act_quant._act_quant_kernel,
                 dict(x_ptr="*bf16", q_ptr="*u8", s_ptr="*fp32"),
                 dict(BLOCKS=8, QB=128, ROUND_ONLY=False), 4, 2, ("M", "K"))
    _sm90_report("act_round fp32 (8 blocks of 128)", fp8_act_quant._act_quant_kernel,
                 dict(x_ptr="*fp32", q_ptr="*fp32", s_ptr="*fp32"),
                 dict(BLOCKS=8, QB=128, ROUND_ONLY=True), 4, 2, ("M", "K"))
    _sm90_report("split_sum", G._split_sum_kernel, dict(ws_ptr="*fp32", out_ptr="*bf16"),
                 dict(SPLIT=4, BLOCK=1024), 4, 2, ("MN",))
    for M in GEMM_M:
        for act_quant in (True, False):
            c = G.gemm_config(M, 4096, 4096, act_quant)
            out = "*fp32" if c["split"] > 1 else "*bf16"
            tag = (f"M={M} {c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']} w{c['num_warps']} "
                   f"s{c['num_stages']} split={c['split']}")
            tiles = dict(BLOCK_M=c["BLOCK_M"], BLOCK_N=c["BLOCK_N"], GROUP_M=8)
            if act_quant:
                fuse = c["fuse_quant"]
                _sm90_report(f"fp8 gemm {tag}{' fused quant' if fuse else ''}",
                             G._fp8_gemm_kernel,
                             dict(a_ptr="*bf16" if fuse else "*fp8e4nv", as_ptr="*fp32",
                                  b_ptr="*fp8e4nv", bs_ptr="*fp32", c_ptr=out),
                             dict(tiles, QUANT_A=fuse), c["num_warps"], c["num_stages"],
                             ("M", "N", "K", "KB_PER_SPLIT"))
            else:
                _sm90_report(f"wo gemm {tag}", G._wo_gemm_kernel,
                             dict(a_ptr="*bf16", b_ptr="*fp8e4nv", bs_ptr="*fp32", c_ptr=out),
                             dict(tiles, BLOCK_K=c["BLOCK_K"], DOT_PREC="tf32"),
                             c["num_warps"], c["num_stages"], ("M", "N", "K"))
    if only != "gemm":
        _moe_compile_report()


def _moe_compile_report():
    import triton.language as tl

    from dsv4_kernels import fp4_gemv_moe, fp4_moe, fp4_words
    from dsv4_kernels import moe

    _sm90_report("moe_align one kernel (E 256)", moe._align_one_kernel,
                 dict(ids_ptr="*i32", sorted_ptr="*i32", block_expert_ptr="*i32", used_ptr="*i32"),
                 dict(BLOCK_M=16, MP=512, EP=256, FILL=32, FB=1), 4, 1,
                 ("M", "E", "CAP", "MAX_BLOCKS"))

    for T in (1, 64, 512, 1024, 2048, 8192):  # each tier of moe_config
        # (act_quant changes no bf16 kernel: the host rounds x first)
        for act_quant, step, pair in ((False, False, False), (True, True, False), (True, True, True)):
            c = fp4_moe.moe_config(T, MOE_TOPK)
            wt = "*i32" if pair else "*i8"  # the pair decode reads int32 words
            kw = dict(NUM_EXPERTS=MOE_E // 2, BLOCK_M=c["block_m"], DOT_PREC="tf32",
                      CHUNKS=4, STEP_DOT=step, PAIR_DECODE=pair)
            decode = (" step_dot" if step else "") + (" pair" if pair else "")
            tag = (f"T={T} bf16{decode} act_quant={act_quant} bm={c['block_m']} "
                   f"bn={c['block_n_up']}/{c['block_n_down']} w{c['num_warps']} "
                   f"s{c['num_stages']}")
            _sm90_report(f"moe gate_up {tag}", fp4_moe._fp4_gate_up_kernel,
                         dict(a_ptr="*bf16", w1_ptr=wt, w1s_ptr="*u8", w3_ptr=wt, w3s_ptr="*u8",
                              sorted_ids_ptr="*i32", block_expert_ptr="*i32",
                              weights_ptr="*fp32", h_ptr="*bf16", limit="fp32"),
                         dict(kw, HAS_LIMIT=True, X_DTYPE=tl.bfloat16, BLOCK_N=c["block_n_up"]),
                         c["num_warps"], c["num_stages"], ("M", "topk"))
            _sm90_report(f"moe down {tag}", fp4_moe._fp4_down_kernel,
                         dict(h_ptr="*bf16", w2_ptr=wt, w2s_ptr="*u8", sorted_ids_ptr="*i32",
                              block_expert_ptr="*i32", partial_ptr="*fp32"),
                         dict(kw, BLOCK_N=c["block_n_down"]), c["num_warps"], c["num_stages"],
                         ("M",))
    gemv_configs = [fp4_gemv_moe.gemv_config(T, MOE_TOPK) for T in (1, 16, 256)]  # bm 1, 2, 4
    gemv_configs += [dict(gemv_configs[0], block_m=m) for m in (2, 4)]  # bench's _narrow
    gemv_configs += [dict(gemv_configs[1], block_m=1)]  # bench's _wide / _bm1
    for c in gemv_configs:
        kw = dict(NUM_EXPERTS=MOE_E // 2, BLOCK_M=c["block_m"])
        tag = (f"gemv bm={c['block_m']} bn={c['block_n_up']}/{c['block_n_down']} "
               f"k={32 * c['chunks']} w{c['num_warps']} s{c['num_stages']}")
        _sm90_report(f"moe gate_up {tag}", fp4_gemv_moe._gemv_gate_up_kernel,
                     dict(a_ptr="*bf16", w1_ptr="*i32", w1s_ptr="*u8", w3_ptr="*i32",
                          w3s_ptr="*u8", sorted_ids_ptr="*i32", block_expert_ptr="*i32",
                          weights_ptr="*fp32", h_ptr="*bf16", limit="fp32"),
                     dict(kw, HAS_LIMIT=True, BLOCK_N=c["block_n_up"], X_DTYPE=tl.bfloat16,
                          CHUNKS=fp4_words.chunks(MOE_D, c["chunks"])),
                     c["num_warps"], c["num_stages"], ("M", "topk"))
        _sm90_report(f"moe down {tag}", fp4_gemv_moe._gemv_down_kernel,
                     dict(h_ptr="*bf16", w2_ptr="*i32", w2s_ptr="*u8", sorted_ids_ptr="*i32",
                          block_expert_ptr="*i32", partial_ptr="*fp32"),
                     dict(kw, BLOCK_N=c["block_n_down"],
                          CHUNKS=fp4_words.chunks(MOE_I, c["chunks"])),
                     c["num_warps"], c["num_stages"], ("M",))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--quick", action="store_true",
                    help=f"M/T in {QUICK_SIZES}, the 128-expert shard only, plus an alternative "
                         "FP8 tile at M >= 2048 (under a minute)")
    ap.add_argument("--only", choices=("gemm", "moe"), default=None)
    ap.add_argument("--moe-t", type=int, nargs="+", default=None,
                    help="MoE token counts to time (default: --quick's or the full list)")
    ap.add_argument("--compile-report", action="store_true",
                    help="no GPU needed: compile every kernel config for sm_90 and print "
                         "registers / spills / shared memory")
    args = ap.parse_args(argv)
    if args.compile_report:
        compile_report(args.only)
        return 0
    if not require_cuda():
        return 0
    torch.manual_seed(0)
    rows, t0 = [], time.time()
    if args.only in (None, "gemm"):
        print("== FP8 block GEMM (bf16 x; Flash linears)")
        bench_gemm(rows, QUICK_SIZES if args.quick else GEMM_M, alt_tile=args.quick)
    if args.only in (None, "moe"):
        print(f"== FP4 MoE d={MOE_D} I={MOE_I} top-{MOE_TOPK} of {MOE_E} (bf16 x)")
        t_list = args.moe_t or (QUICK_SIZES if args.quick else MOE_T)
        if args.quick:
            bench_moe(rows, t_list, (MOE_E // 2,))
        else:
            bench_moe(rows, t_list)
    print(f"done in {time.time() - t0:.0f} s")
    if args.out:
        meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                    fp8_peak_tflops=FP8_PEAK_TFLOPS, bf16_peak_tflops=BF16_PEAK_TFLOPS,
                    hbm_gbps=hbm_gbps(), reps=REPS)
        Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
