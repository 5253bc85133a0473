"""Which model code launches a step's GPU time: one eager step under torch.profiler, every torch
op's own device time (the kernels it launched) attributed to the innermost module running it
and to the op's input shapes. This is the view that finds the torch glue worth fusing
(docs/benchmarks.md §3). It covers torch ops only: Triton kernels launched from Python
have no torch op around them and torch.profiler ties none of their time to a range here (on an
H200 the table's total was about a third of the step's kernel time), so read them from
`bench_one_batch --profile-kernels`, which lists every kernel.

    python benchmark/profiling/attribute_kernels.py --model-path dsv4-flash --load-format dummy --num-layers 4 \
        --modes mixed --num-tokens 4096 [--top 50]

Takes bench_one_batch's flags (the first --modes / --num-tokens value is profiled). On CPU the
ops' own CPU time is reported instead.
"""

import collections
import functools
import re
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from sglang.bench_one_batch import parse_args
from sglang.bench_one_batch_steps import _sync, make_batch, server_args_for
from sglang.srt.model_executor.graph_dispatch import eager_path
from sglang.srt.model_executor.model_runner import ModelRunner

MOD = "module:"


def _label_modules(model) -> None:
    """A record_function range around every module's forward, named by its path (layer indices
    folded to *: every layer's ops add up in one row)."""
    def enter(mod, args, name):
        rf = torch.profiler.record_function(MOD + name)
        rf.__enter__()
        mod.__dict__.setdefault("_attribution_ranges", []).append(rf)

    def leave(mod, args, out):
        mod.__dict__["_attribution_ranges"].pop().__exit__(None, None, None)

    for name, mod in model.named_modules():
        name = re.sub(r"\.\d+(\.|$)", r".*\1", name) or "(model)"
        mod.register_forward_pre_hook(functools.partial(enter, name=f"{name} ({type(mod).__name__})"))
        mod.register_forward_hook(leave)


def _owner(event) -> str:
    p = event.cpu_parent
    while p is not None:
        if p.name.startswith(MOD):
            return p.name[len(MOD):]
        p = p.cpu_parent
    return "(outside the model)"


def attribute(fn, cuda: bool) -> list:
    """[((module, op), calls, ms, first input shapes)], largest first. A kernel counts toward the
    innermost op around its launch (time the profiler gives a module's own range, if any, is
    listed as that module's "(outside torch ops)")."""
    fn()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []),
                 record_shapes=True) as prof:
        fn()
        _sync(torch.device("cuda" if cuda else "cpu"))
    rows = collections.defaultdict(lambda: [0, 0.0, ""])
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CPU:
            continue
        us = ev.self_device_time_total if cuda else ev.self_cpu_time_total
        if us <= 0:
            continue
        if ev.name.startswith(MOD):
            key = (ev.name[len(MOD):], "(outside torch ops)")
        else:
            key = (_owner(ev), ev.name)
        row = rows[key]
        row[0] += 1
        row[1] += us / 1e3
        row[2] = row[2] or str(ev.input_shapes)[:80]
    return sorted(((k, *v) for k, v in rows.items()), key=lambda r: -r[2])


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    top = 50
    if "--top" in argv:
        i = argv.index("--top")
        top = int(argv[i + 1])
        del argv[i:i + 2]
    a = parse_args(argv)
    runner = ModelRunner(server_args_for(a))
    try:
        mode, n = a.modes[0], a.num_tokens[0]
        fb, _ = make_batch(runner, mode, n, a.prefix, a.max_chunk, a.decode_rows)
        _label_modules(runner.model)
        path = eager_path(fb)
        rows = attribute(lambda: runner.forward(fb, path), runner.device.type == "cuda")
        total = sum(r[2] for r in rows)
        unit = "GPU" if runner.device.type == "cuda" else "CPU"
        print(f"{a.model_path} ({a.num_layers or 'all'} layers) {mode} {n}: {total:.3f} ms of {unit} time in "
              f"{sum(r[1] for r in rows)} op calls")
        by_module = collections.Counter()
        for (owner, _), _, ms, _ in rows:
            by_module[owner] += ms
        print("by module:")
        for owner, ms in by_module.most_common(25):
            print(f"  {ms:9.3f} ms {ms / total:6.1%}  {owner}")
        print(f"top {top} (module, op):")
        for (owner, op), calls, ms, shapes in rows[:top]:
            print(f"  {ms:9.3f} ms {ms / total:6.1%} {calls:4d}x  {op:32s} {owner[:58]:58s} {shapes}")
    finally:
        runner.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
