"""benchmark/profiling/layer_kernels.py: a step's kernel sequence cut into layers (two mHC mixings
each), one list per distinct layer kind with the mean time of each kernel."""

from __future__ import annotations

import json

import pytest

from sglang.test.repo_scripts import load_script


def _layer(attn: str, us: float) -> list:
    return [["_hc_mixes_kernel", 1.0], [f"void {attn}<128, 4>(int*)", us], ["_hc_post_kernel", 1.0],
            ["_hc_mixes_kernel", 1.0], ["humming<Shape<1>>", 2.0], ["_hc_post_kernel", 1.0]]


def test_layers_are_cut_at_every_second_mixing_and_grouped_by_kind(tmp_path, capsys):
    tool = load_script("benchmark/profiling/layer_kernels.py")
    head = [["_step_metadata_kernel", 1.5]]
    seq = head + _layer("window_attn", 3.0) + _layer("c4_attn", 5.0) + _layer("window_attn", 4.0) \
        + [["_rms_norm_kernel", 2.0], ["logits_gemm", 9.0]]
    before, layers = tool.layers(seq)
    assert before == head and len(layers) == 3
    assert [len(layer) for layer in layers] == [6, 6, 6]  # the last layer stops at its FFN's mHC post
    result = tmp_path / "r.json"
    result.write_text(json.dumps(dict(rows=[dict(mode="decode", tokens=1, kernels=dict(sequence_us=seq),
                                                 graph_kernels=dict(sequence_us=seq))])))
    assert tool.main([str(result)]) == 0
    out = capsys.readouterr().out
    assert "decode 1: 21 kernels" in out and "3 layers (graph replay)" in out
    assert "layers [0, 2]: 6 kernels, 9.5 us per layer" in out  # mean of the two window layers (9 and 10)
    assert "layers [1]: 6 kernels, 11.0 us per layer" in out
    assert "window_attn" in out and "<" not in out.split("layers [0, 2]")[1]


def test_the_last_layer_may_end_in_the_gemv_that_writes_the_streams():
    """FP8 decode rows: the shared expert's down GEMV writes the mHC streams (no `_hc_post`)."""
    tool = load_script("benchmark/profiling/layer_kernels.py")
    layer = [["_hc_mixes_kernel", 1.0], ["_sparse_attn_kernel", 3.0], ["_fp8_gemv_kernel", 1.0],
             ["_hc_mixes_kernel", 1.0], ["humming", 2.0], ["_fp8_gemv_kernel", 1.0]]
    _, layers = tool.layers(layer + layer + [["at::native::reduce_kernel", 2.0], ["logits_gemm", 9.0]])
    assert [len(x) for x in layers] == [6, 6]


def test_a_sequence_without_layers_is_refused():
    with pytest.raises(ValueError, match="two _hc_mixes_kernel launches per layer"):
        load_script("benchmark/profiling/layer_kernels.py").layers([["_hc_mixes_kernel", 1.0], ["x", 1.0]])
