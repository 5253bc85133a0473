"""Tune humming's indexed GEMMs for the FP4 MoE at DSV4-Flash's expert dims on this GPU, and write
the per-device data file the humming backend reads
(python/sglang/srt/layers/moe/backends/configs/humming_<gpu>.json).

For each GEMM (gate/up "w13": n = 2 x 2048, k = 4096; down "w2": n = 4096, k = 2048), each
number of local experts (--experts: 256 = all on one GPU, 128 = an EP-2 shard) and each
activation type (--acts: fp8 = release numerics, bf16 = weight-only), the candidates are
the configurations of the backend's current list (humming's heuristics without a data file)
plus --sample configurations from humming's candidate generator. All are compiled first
(in parallel), then each is timed alone at every T of --t (uniform random top-6 routing,
CUDA-graph replays, cold L2, median of REPS), and so is moe_align at each block height. Per T
the pair of gate/up and down configurations with the least GEMM + alignment time wins: the
step aligns once per distinct block height, so a pair sharing one saves a launch. Consecutive
T whose winner is the same configuration merge into one M range; range edges sit halfway
between grid points (in the rows the backend looks up: T x top-k x local / total experts). A candidate that
fails to launch or disagrees with the current one is dropped.

    python sgl-kernel/benchmark/tune_humming_moe.py [--experts 256 128] [--acts fp8] [--sample 12]
    python sgl-kernel/benchmark/tune_humming_moe.py --experts 256 --t 1 2 4 8 --sample 32  # decode sizes

A --t grid that stops short of the default's largest T retunes only the rows up to its largest T;
the file's earlier ranges above that are kept (spliced). Lists of other GEMMs, expert counts
and activation types stay as they were.

Prints every T's best time beside the current configuration's (the gain tuning buys), per GEMM
and for the pair with its alignments.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))
from bench_quant import _time  # noqa: E402
from common import require_cuda  # noqa: E402

D, I, TOPK, N_TOTAL = 4096, 2048, 6, 256
T_GRID = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
REPS = 15


def time_graph(fn) -> float:
    return _time(fn, REPS)[0]  # median ms of graph replays, cold L2


def candidates(gemm, sample: int) -> list:
    """The configurations of the backend's list (humming's heuristics without a data file) and
    `sample` more from humming's candidate generator, each once."""
    from humming.config import ComputeConfig
    from humming.testing.tuning import sample_test_tuning_configs

    pool = {json.dumps(c, sort_keys=True): c for _, _, c in gemm.tuning}
    if sample:
        for c in sample_test_tuning_configs(gemm.config, ComputeConfig(gemm_type="indexed"), sample):
            c = {k: (v.value if hasattr(v, "value") else v) for k, v in c.items()}
            pool.setdefault(json.dumps(c, sort_keys=True), c)
    return list(pool.values())


def current(gemm, m: int) -> dict:
    """The configuration the backend runs at m rows today."""
    return next(c for lo, hi, c in gemm.tuning if lo < m <= hi)


def tune_one(experts, name: str, t_grid, sample: int, gen):
    """{T: ({config key: (ms, config)} of every candidate that ran right, the current one's key)}
    for one GEMM of one experts module."""
    from dsv4_kernels.moe import moe_align
    from dsv4_kernels.moe_act import quantize_rows
    from humming.forward import humming_forward
    from humming.kernel.humming import HummingKernel

    from sglang.srt.layers.moe.backends.humming_moe import COMPUTE_CONFIG

    g = experts.humming[name]
    n_local = experts.dims[0]
    pool = candidates(g, sample)
    try:  # one parallel compile of the whole pool (dummy M ranges)
        HummingKernel.prepare_kernels(g.config.to_str(), COMPUTE_CONFIG,
                                      json.dumps([[i, i + 1, c] for i, c in enumerate(pool)]), experts.hm_locks.device)
    except Exception as e:  # some sampled candidate does not build: compile one by one below
        print(f"  {name}: pooled compile failed ({type(e).__name__}), compiling singly", flush=True)
    fp8 = experts.act_quant
    k = g.config.shape_k
    results = {}
    for T in t_grid:
        M = T * TOPK
        m = rows_of(T, n_local)
        _, ids = torch.randn(T, N_TOTAL, device="cuda", generator=gen).topk(TOPK, dim=1)
        rows = T if name == "w13" else M
        a = torch.randn(rows, k, device="cuda", generator=gen).bfloat16()
        inp, scale = quantize_rows(a) if fp8 else (a, None)
        out = torch.empty(M, g.config.shape_n, dtype=torch.bfloat16, device="cuda")
        times = {}
        ref_out = None
        base = current(g, m)
        for c in [base] + pool:
            key = json.dumps(c, sort_keys=True)
            if key in times:
                continue
            block = int(c["block_shape"][0])
            sorted_ids, block_expert, padded = moe_align(ids, n_local, block, return_used=True)
            tuning = json.dumps(c)

            def run():
                humming_forward(g.config, inputs=inp, weight=getattr(experts, f"hm_{name}_weight"),
                                weight_scale=getattr(experts, f"hm_{name}_weight_scale", None),
                                weight_scale_2=getattr(experts, f"hm_{name}_weight_scale_2", None), outputs=out,
                                input_scale=scale, sorted_ids=sorted_ids, expert_ids=block_expert,
                                num_tokens_padded=padded, locks=experts.hm_locks,
                                top_k=TOPK if name == "w13" else 1, valid_shape_m=m,
                                compute_config=COMPUTE_CONFIG, tuning_config=tuning)
            try:
                run()
                torch.cuda.synchronize()
                valid = ids.reshape(-1) < n_local
                got = out[valid].float()
                if ref_out is None:
                    ref_out = got.clone()
                elif not torch.allclose(got, ref_out, rtol=2e-2, atol=2e-2 * ref_out.abs().max().item()):
                    continue  # a wrong answer is no candidate
                times[key] = (time_graph(run), c)
            except Exception as e:  # a candidate that does not launch here is no candidate
                print(f"  {name} T={T}: candidate failed: {type(e).__name__}: {str(e)[:80]}", flush=True)
        base_key = json.dumps(base, sort_keys=True)
        best_ms, best = min(times.values(), key=lambda v: v[0])
        results[T] = (times, base_key)
        print(f"  {name} T={T:<6} best {best_ms * 1e3:8.1f} us (block {best['block_shape']}) vs current "
              f"{times[base_key][0] * 1e3:8.1f} us  ({len(times)} candidates)", flush=True)
    return results


def block_height(config: dict) -> int:
    """The rows of an expert block, what moe_align pads each expert's group to."""
    return int(config["block_shape"][0])


def align_times(n_local: int, t_grid, blocks, gen) -> dict:
    """{T: {block height: ms of one moe_align launch}} at uniform random top-6 routing."""
    from dsv4_kernels.moe import moe_align

    out = {}
    for T in t_grid:
        _, ids = torch.randn(T, N_TOTAL, device="cuda", generator=gen).topk(TOPK, dim=1)
        ids = ids.int()
        out[T] = {b: time_graph(lambda b=b: moe_align(ids, n_local, b, return_used=True)) for b in sorted(blocks)}
    return out


def pick_pairs(w13: dict, w2: dict, align: dict) -> dict:
    """{T: (gate/up config, down config, step ms, current step ms)}: per T the pair of candidates
    whose GEMMs and alignments cost least together. The step aligns once per distinct block
    height (humming_moe.HummingFp4MoE.forward), so two fast GEMMs of different heights can lose
    to a pair sharing one."""
    out = {}
    for T in w13:
        (times13, base13), (times2, base2) = w13[T], w2[T]

        def cost(c13, c2):
            heights = {block_height(c13), block_height(c2)}
            return sum(align[T][h] for h in heights)

        best = min(((t13 + t2 + cost(c13, c2), c13, c2) for t13, c13 in times13.values() for t2, c2 in times2.values()),
                   key=lambda v: v[0])
        (t13, c13), (t2, c2) = times13[base13], times2[base2]
        out[T] = (best[1], best[2], best[0], t13 + t2 + cost(c13, c2))
    return out


def rows_of(T: int, n_local: int) -> int:
    """The rows the backend looks a configuration up by (humming_moe.HummingFp4MoE.forward)."""
    return max(1, -(-T * TOPK * n_local // N_TOTAL))


def ranges(results, n_local: int) -> list:
    """[[min_m, max_m, config], ...]: each T's winner from halfway after the previous T's rows to
    halfway before the next one's."""
    ms = {T: rows_of(T, n_local) for T in results}
    ts = sorted(results)
    out = []
    for i, T in enumerate(ts):
        lo = 0 if i == 0 else (ms[ts[i - 1]] + ms[T]) // 2
        hi = 1 << 30 if i == len(ts) - 1 else (ms[T] + ms[ts[i + 1]]) // 2
        cfg = results[T][0]
        if out and out[-1][2] == cfg:
            out[-1][1] = hi
        else:
            out.append([lo, hi, cfg])
    return out


def splice(new: list, old: list, cut: int) -> list:
    """The tuned ranges below `cut` rows, the earlier file's from there on: retuning part of the
    T grid (--t a few sizes) keeps what the rest of the grid measured before."""
    out = [[lo, min(hi, cut), c] for lo, hi, c in new if lo < cut]
    out += [[max(lo, cut), hi, c] for lo, hi, c in old if hi > cut]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--experts", type=int, nargs="+", default=[256, 128])
    ap.add_argument("--acts", nargs="+", default=["fp8"], choices=["fp8", "bf16"])
    ap.add_argument("--t", type=int, nargs="+", default=T_GRID)
    ap.add_argument("--sample", type=int, default=12, help="sampled candidates per GEMM beside the current ones")
    ap.add_argument("--out", help="data file to write (default: the backend's configs/ file for this GPU)")
    a = ap.parse_args()
    if not require_cuda():
        return
    from bench_moe_backends import make_experts
    from bench_quant import fp4_expert_weights

    from sglang.srt.layers.moe.backends.humming_moe import CONFIG_DIR, device_key, gemm_key, load_tuned

    dev = torch.cuda.current_device()
    path = Path(a.out) if a.out else CONFIG_DIR / f"humming_{device_key(dev)}.json"
    tuned = dict(load_tuned(dev))  # the lists this run does not retune are kept
    gen = torch.Generator(device="cuda").manual_seed(0)
    for n_local in a.experts:
        packed = fp4_expert_weights(n_local, gen)
        for act in a.acts:
            experts = make_experts(N_TOTAL, n_local, act == "fp8", "humming", packed)
            times = {}
            for name in ("w13", "w2"):
                g = experts.humming[name]
                print(f"== {name} n={g.config.shape_n} k={g.config.shape_k} experts {n_local}/{N_TOTAL} act {act}",
                      flush=True)
                times[name] = tune_one(experts, name, a.t, a.sample, gen)
            heights = {block_height(c) for per_t in times.values() for ts, _ in per_t.values() for _, c in ts.values()}
            pairs = pick_pairs(times["w13"], times["w2"], align_times(n_local, a.t, heights, gen))
            for T, (c13, c2, ms, current_ms) in pairs.items():
                print(f"  pair T={T:<6} {ms * 1e3:8.1f} us with alignments (blocks {block_height(c13)}, "
                      f"{block_height(c2)}) vs current {current_ms * 1e3:8.1f} us", flush=True)
            for j, name in enumerate(("w13", "w2")):
                g = experts.humming[name]
                key = gemm_key(name, g.config.shape_n, g.config.shape_k, n_local, N_TOTAL, act == "fp8")
                new = ranges({T: (pair[j],) for T, pair in pairs.items()}, n_local)
                if key in tuned and max(a.t) < max(T_GRID):  # a partial grid: splice into the old list
                    new = splice(new, tuned[key], rows_of(max(a.t), n_local))
                tuned[key] = new
            del experts
            torch.cuda.empty_cache()
        del packed
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"device": torch.cuda.get_device_name(dev), "configs": tuned}, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
