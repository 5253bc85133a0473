"""The kernel list of one decoder layer of each kind, from a `bench_one_batch --profile-kernels`
result file: every kernel a layer launches, in launch order, with its GPU time.

    python -m sglang.bench_one_batch --model-path dsv4-flash --load-format dummy --num-layers 20 \
        --modes decode --num-tokens 1 --profile-kernels 10 --result-file decode.json
    python benchmark/profiling/layer_kernels.py decode.json [--row 0] [--eager] [--markdown]

A layer starts at its first mHC mixing kernel (`_hc_mixes_kernel`, two per layer: attention and
FFN). Flash's layers come in three kinds by compression ratio: window only (layers 0-1), ratio 4
(with the indexer) and ratio 128; the first three layers route by token hash. One layer of each
distinct kernel list is shown (the decode graph replay's sequence unless --eager), with the
count of layers sharing it and the layer's kernel count and time.
"""

import argparse
import json
import sys

LAYER_START = "_hc_mixes_kernel"
LAYER_END = ("_hc_post_kernel", "_fp8_gemv_kernel")  # what a layer's FFN ends with


def short(name: str) -> str:
    """A kernel's name without template arguments and signatures."""
    for cut in ("<", "("):
        name = name.split(cut)[0]
    return name.replace("void ", "").strip()


def layers(sequence: list) -> tuple[list, list]:
    """(kernels before the first layer, [each layer's kernels]), a layer = two mHC mixings."""
    starts = [i for i, (name, _) in enumerate(sequence) if name.startswith(LAYER_START)]
    if len(starts) < 2 or len(starts) % 2:
        raise ValueError(f"expected two {LAYER_START} launches per layer, found {len(starts)}")
    bounds = starts[::2] + [None]
    out = [sequence[bounds[i]:bounds[i + 1]] for i in range(len(bounds) - 1)]
    # the last layer's slice runs to the end of the step: cut the head off after the last FFN's
    # mHC post, which is its own kernel or (FP8 decode rows) the epilogue of the shared expert's
    # down GEMV
    last = out[-1]
    tail = max(i for i, (name, _) in enumerate(last) if name.startswith(LAYER_END))
    out[-1] = last[:tail + 1]
    return sequence[:starts[0]], out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("result_file")
    p.add_argument("--row", type=int, default=0, help="the result's row (default 0)")
    p.add_argument("--eager", action="store_true", help="the eager step's kernels, not the graph replay's")
    p.add_argument("--markdown", action="store_true", help="markdown tables")
    a = p.parse_args(argv)
    row = json.load(open(a.result_file))["rows"][a.row]
    prof = row["kernels"] if a.eager or "graph_kernels" not in row else row["graph_kernels"]
    if "sequence_us" not in prof:
        sys.exit("the result file has no kernel sequence: rerun bench_one_batch with --profile-kernels")
    _, per_layer = layers(prof["sequence_us"])
    kinds: dict = {}
    for i, layer in enumerate(per_layer):
        kinds.setdefault(tuple(short(n) for n, _ in layer), []).append((i, layer))
    total = sum(t for _, t in prof["sequence_us"])
    print(f"{row['mode']} {row['tokens']}: {len(prof['sequence_us'])} kernels, {total / 1e3:.3f} ms of GPU time, "
          f"{len(per_layer)} layers ({'eager step' if prof is row['kernels'] else 'graph replay'})")
    for names, members in kinds.items():
        idx = [i for i, _ in members]
        first = members[0][1]
        mean = [sum(layer[j][1] for _, layer in members) / len(members) for j in range(len(names))]
        print(f"\nlayers {idx}: {len(names)} kernels, {sum(mean):.1f} us per layer")
        if a.markdown:
            print("\n| # | kernel | us |\n| ---: | --- | ---: |")
        for j, (name, us) in enumerate(zip(names, mean)):
            print(f"| {j} | `{name}` | {us:.1f} |" if a.markdown else f"  {j:3d} {us:7.1f} us  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
