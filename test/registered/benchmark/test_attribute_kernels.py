"""benchmark/profiling/attribute_kernels.py on CPU (dsv4-tiny, 4 layers): one eager step's op time,
attributed to the innermost module running each op, layer indices folded together."""

from __future__ import annotations

import re

from sglang.test.repo_scripts import load_script
from test_bench_one_batch import SMALL


def test_attribution_folds_layers_and_names_the_owner_of_each_op(capfd):
    # every row (not a top 12): which op ranks where is timing, and timing moves with machine load
    tool = load_script("benchmark/profiling/attribute_kernels.py")
    assert tool.main([*SMALL, "--modes", "extend", "--top", "100000"]) == 0
    out = capfd.readouterr().out
    head = re.search(r"dsv4-tiny \(all layers\) extend 8: ([\d.]+) ms of CPU time in (\d+) op calls", out)
    assert head, out
    total = float(head.group(1))
    modules = re.findall(r"^\s+([\d.]+) ms\s+([\d.]+)%\s+(\S.*)$", out.split("by module:")[1].split("top 100000")[0],
                         re.M)
    assert modules and all("layers.*" in m[2] or "(" in m[2] for m in modules)
    assert not any(re.search(r"layers\.\d", m[2]) for m in modules)  # every layer in one row
    ms = [float(m[0]) for m in modules]
    assert ms == sorted(ms, reverse=True) and sum(ms) <= total * 1.001
    top = re.findall(r"^\s+([\d.]+) ms\s+[\d.]+%\s+(\d+)x  (\S+)\s+(\S+)", out.split("top 100000 (module, op):")[1], re.M)
    assert len(top) > 12
    top_ms = [float(t[0]) for t in top]
    assert top_ms == sorted(top_ms, reverse=True)
    # the break op runs once per layer, inside the attention module
    assert any(op == "sglang::deepseek_v4_attention_with_output" and calls == "4" and owner == "layers.*.attn"
               for _, calls, op, owner in top), out
