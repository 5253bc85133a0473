"""Compiles every kernel at its real-shape GPU config for sm_90 WITHOUT a GPU (Triton's bundled
ptxas) and prints registers, spill stack, shared memory and the MMA kind. A quick check that a
config change still compiles, fits and does not spill: python sgl-kernel/benchmark/sm90_resources.py
"""

import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
warnings.filterwarnings("ignore")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402


def compile_report(name, fn, ptr_types, constexprs, num_warps, num_stages=2, scalar_types=None):
    """ptr_types: arg -> '*bf16' etc.; other non-constexpr args default to i32."""
    scalar_types = scalar_types or {}
    # constexprs with a default (PDL: off, as on any launch that does not ask for it) take it
    constexprs = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}, **constexprs}
    missing = [p.name for p in fn.params if p.is_constexpr and p.name not in constexprs]
    assert not missing, f"constexpr args without a value (would compile as runtime): {missing}"
    sig = {a: "constexpr" if a in constexprs else ptr_types.get(a, scalar_types.get(a, "i32"))
           for a in fn.arg_names}
    kernel = triton.compile(ASTSource(fn, sig, constexprs), target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=num_warps, num_stages=num_stages))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        tool = Path(triton.__path__[0]) / "backends" / "nvidia" / "bin" / "cuobjdump"
        usage = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True,
                               text=True).stdout
    fields = dict(tok.split(":", 1) for line in usage.splitlines() if "REG:" in line
                  for tok in line.split() if ":" in tok)
    ptx = kernel.asm["ptx"]
    mma = "wgmma" if "wgmma" in ptx else "mma.sync" if "mma.sync" in ptx else "-"
    print(f"{name:<44} regs {fields.get('REG', '?'):>4}  spill-stack {fields.get('STACK', '?'):>5}  "
          f"smem {kernel.metadata.shared:>7}  mma {mma}", flush=True)


def main():
    from dsv4_kernels import cache_write, compressor, fp8_gemv, indexer, moe, sparse_attention as sa

    attn_ptrs = dict(q_ptr="*bf16", kv_a_ptr="*bf16", idx_a_ptr="*i32", len_a_ptr="*i32",
                     kv_b_ptr="*bf16", idx_b_ptr="*i32", len_b_ptr="*i32", sink_ptr="*fp32",
                     out_ptr="*bf16", part_acc_ptr="*fp32", part_m_ptr="*fp32", part_l_ptr="*fp32",
                     rows_a_ptr="*i32", rows_b_ptr="*i32", rope_a_ptr="*bf16", rope_b_ptr="*bf16",
                     cos_ptr="*fp32", sin_ptr="*fp32", pos_ptr="*i64", keep_ptr="*i32")
    # each tier of configs/sparse_attention_tiles.json as the model launches it: bf16 and FP8
    # (584-byte) KV rows; the decode tier split 16 ways with the output's inverse RoPE and the
    # window-ring move in the launch, also with list b read through the page table (c128)
    for bound, tiles, fp8_tiles in sa._TIERS:
        decode = bound is not None and bound < 16
        for fp8, paged in ((False, False), (True, False)) + (((True, True),) if decode else ()):
            cfg = fp8_tiles if fp8 else tiles
            ptrs = dict(attn_ptrs, kv_a_ptr="*u8", kv_b_ptr="*u8") if fp8 else attn_ptrs
            compile_report(f"sparse_attn T<={bound} h{cfg.block_h} n{cfg.block_n} w{cfg.num_warps}"
                           f"{' keys_as_m' if cfg.keys_as_m else ''}{' fp8 kv' if fp8 else ''}"
                           f"{' c128 paged' if paged else ''}",
                           sa._sparse_attn_kernel, ptrs,
                           dict(HAS_B=True, NUM_SPLITS=16 if decode else 1, OUT_ROPE=decode, KEEP_ROWS=decode,
                                BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, BLOCK_D=512, DOT_PREC="tf32",
                                KEYS_AS_M=cfg.keys_as_m, KV_FP8=fp8, FP8_BLOCK=64, DEQ_BF16=True,
                                PAGED_A=False, RATIO_A=1, PAGED_B=paged, RATIO_B=128 if paged else 1),
                           cfg.num_warps, cfg.num_stages, dict(qk_scale="fp32"))
    compile_report("sparse_attn merge splits=4 (D chunk 128)", sa._merge_splits_kernel,
                   dict(part_acc_ptr="*fp32", part_m_ptr="*fp32", part_l_ptr="*fp32",
                        sink_ptr="*fp32", out_ptr="*bf16", cos_ptr="*fp32", sin_ptr="*fp32", pos_ptr="*i64"),
                   dict(NUM_SPLITS=4, BLOCK_H=16, BLOCK_D=128, OUT_ROPE=True), 4)
    for mode in ("bf16", "round", "fp8 rows"):  # KV pool: as is, nope FP8-rounded, FP8 rows
        compile_report(f"norm_rope_row (cache write, D=512, {mode})", cache_write._norm_rope_row_kernel,
                       dict(x_ptr="*bf16", weight_ptr="*fp32", cos_ptr="*fp32", sin_ptr="*fp32",
                            pos_ptr="*i64", out_ptr="*bf16", pool_ptr="*u8" if mode == "fp8 rows" else "*bf16",
                            loc_ptr="*i32", rope_pool_ptr="*bf16"),
                       dict(HAS_NORM=True, HAS_WEIGHT=True, INVERSE=False, HAS_OUT=True,
                            HAS_POOL=True, BLOCK_HALF=256, NOPE_FP8=mode != "bf16",
                            FP8_ROWS=mode == "fp8 rows", NUM_SCALES=7, PAIRS_PER_BLOCK=32), 4,
                       scalar_types=dict(eps="fp32", amax_floor="fp32", inv_qmax="fp32"))
    for ratio, block_c, warps in ((4, 256, 4), (128, 32, 8)):
        compile_report(f"compressor_pool r={ratio} (ape added)", compressor._compressor_pool_kernel,
                       dict(kv_state_ptr="*fp32", score_state_ptr="*fp32", kv_new_ptr="*fp32",
                            score_new_ptr="*fp32", idx_ptr="*i32", out_ptr="*fp32", ape_ptr="*fp32",
                            pos_ptr="*i64"),
                       dict(RATIO=ratio, COFF=2 if ratio == 4 else 1, BLOCK_C=block_c, HAS_APE=True,
                            RING_WRITE=False), warps)
    # the fused emission: Flash's compressors (D 512, ratio 4 / 128, FP8 rows; the indexer's:
    # D 128, ratio 4, entries), the ring update in the launch (a decode step)
    for ratio, D, fp8 in ((4, 512, True), (128, 512, True), (4, 128, False)):
        compile_report(f"compressor_emit r={ratio} D={D}{' fp8 rows' if fp8 else ' entries'}",
                       compressor._compressor_emit_kernel,
                       dict(kv_state_ptr="*fp32", score_state_ptr="*fp32", kv_new_ptr="*fp32", score_new_ptr="*fp32",
                            idx_ptr="*i32", pooled_ptr="*fp32", ape_ptr="*fp32", pos_ptr="*i64", weight_ptr="*fp32",
                            cos_ptr="*fp32", sin_ptr="*fp32", emit_pos_ptr="*i32", out_loc_ptr="*i32",
                            entries_ptr="*bf16", pool_ptr="*u8" if fp8 else "*fp32", rope_pool_ptr="*bf16",
                            ring_loc_ptr="*i32"),
                       dict(RATIO=ratio, COFF=2 if ratio == 4 else 1, BLOCK_C=min(D, 16 if ratio == 128 else 256),
                            HAS_APE=True, BLOCK_HALF=D // 2, HAS_OUT=not fp8, HAS_POOL=fp8, NOPE_FP8=fp8,
                            FP8_ROWS=fp8, NUM_SCALES=7 if fp8 else 0, PAIRS_PER_BLOCK=32, RING_WRITE=True,
                            BLOCK_RING=min(1024, (2 if ratio == 4 else 1) * D)), 4 if D >= 512 else 1,
                       scalar_types=dict(eps="fp32", amax_floor="fp32", inv_qmax="fp32"))
    for paged in (False, True):  # paged: candidates read through the page table
        compile_report(f"indexer_logits 64x128{' paged' if paged else ''}", indexer._indexer_logits_kernel,
                       dict(q_ptr="*bf16", w_ptr="*fp32", key_ptr="*bf16", slots_ptr="*i32",
                            rows_ptr="*i32", len_ptr="*i32", logits_ptr="*i32"),
                       dict(TILES_PER_PROG=4, BLOCK_H=64, BLOCK_N=64, BLOCK_D=128, DOT_PREC="tf32",
                            PAGED=paged, RATIO=4 if paged else 1, OUT=1, FP4_KEYS=False, FP4_BLOCK=32), 4)
        compile_report(f"indexer select{' paged' if paged else ''}", indexer._select_topk_kernel,
                       dict(keys_ptr="*i32", len_ptr="*i32", slots_ptr="*i32", rows_ptr="*i32", out_ptr="*i32"),
                       dict(BLOCK=indexer.SELECT_BLOCK, PAGED=paged, RATIO=4 if paged else 1), 4)
    for bn, bk in ((4, 4096), (8, 2048), (16, 1024)):  # fp8_gemv.gemv_config's tiles at Flash's shapes
        compile_report(f"fp8_gemv {bn}x{bk} w4 (one row, release numerics)", fp8_gemv._fp8_gemv_kernel,
                       dict(x_ptr="*bf16", w_ptr="*fp8e4nv", ws_ptr="*fp32", out_ptr="*bf16"),
                       dict(ROWS=1, BLOCK_N=bn, BLOCK_K=bk, ACT_QUANT=True, SWIGLU=False, HAS_LIMIT=False,
                            ADD=False, HC=False, RMS=False), 4, 2)
    compile_report("moe gate_up 64x64x64", moe._gate_up_kernel,
                   dict(x_ptr="*bf16", w1_ptr="*bf16", w3_ptr="*bf16", sorted_ids_ptr="*i32",
                        block_expert_ptr="*i32", weights_ptr="*fp32", h_ptr="*bf16"),
                   dict(NUM_EXPERTS=256, HAS_LIMIT=True, BLOCK_M=64, BLOCK_N=64, BLOCK_K=64,
                        DOT_PREC="tf32"), 8, 3, dict(limit="fp32"))
    compile_report("moe down 64x64x64", moe._down_kernel,
                   dict(h_ptr="*bf16", w2_ptr="*bf16", sorted_ids_ptr="*i32",
                        block_expert_ptr="*i32", weights_ptr="*fp32", partial_ptr="*bf16"),
                   dict(NUM_EXPERTS=256, BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, DOT_PREC="tf32"), 8, 3)


if __name__ == "__main__":
    main()
