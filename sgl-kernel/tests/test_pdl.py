"""Programmatic dependent launch (dsv4_kernels/pdl.py): the contract every PDL-aware kernel keeps,
read from the source, and when the launches ask for it.

A PDL kernel that touched memory before its `gdc_wait` would race its predecessor on a GPU and
on no CPU test, so the order is checked statically here; test_kernels_compile.py compiles each
such kernel with PDL on for sm_90, and the GPU conformance test holds the rows to the bits of
the stream-ordered launches.
"""

import ast
from pathlib import Path

import pytest
import torch

KERNELS = Path(__file__).resolve().parent.parent / "python" / "dsv4_kernels"


def _pdl_kernels() -> dict:
    """{(module, kernel name): its FunctionDef} for every jit function that takes PDL."""
    found = {}
    for path in sorted(KERNELS.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and any(a.arg == "PDL" for a in node.args.args):
                if node.name != "enter":
                    found[(path.stem, node.name)] = node
    return found


def _first_statement(fn: ast.FunctionDef) -> ast.stmt:
    body = fn.body
    first = body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        body = body[1:]  # the docstring
    return body[0]


def test_the_decode_chain_kernels_take_pdl():
    names = {name for _, name in _pdl_kernels()}
    # the launches of a decode layer that are ours (humming's GEMMs and torch ops are not)
    assert {"_hc_mixes_kernel", "_hc_finish_kernel", "_fp8_gemv_kernel", "_bf16_gemv_kernel", "_q_kv_norm_rope_kernel",
            "_compressor_emit_kernel", "_compressor_pool_kernel", "_rope_rotate_round_kernel",
            "_rotate_round_pack_kernel", "_indexer_logits_kernel", "_select_topk_kernel", "_sparse_attn_kernel",
            "_merge_splits_kernel", "_route_kernel", "_align_quant_kernel", "_swiglu_quant_kernel",
            "_sum_topk_kernel", "_local_ids_kernel"} <= names


def test_every_pdl_kernel_waits_before_anything_else():
    bad = []
    for (module, name), fn in _pdl_kernels().items():
        first = _first_statement(fn)
        call = first.value if isinstance(first, ast.Expr) else None
        ok = (isinstance(call, ast.Call) and ast.unparse(call.func) == "pdl.enter"
              and [ast.unparse(a) for a in call.args] == ["PDL"])
        default = fn.args.defaults[-1] if fn.args.args[-1].arg == "PDL" and fn.args.defaults else None
        if not ok or not (isinstance(default, ast.Constant) and default.value is False):
            bad.append(f"{module}.{name}: first statement {ast.unparse(first)!r}")
    assert bad == [], "a PDL kernel must start with pdl.enter(PDL) and default PDL to False:\n" + "\n".join(bad)


def test_every_launch_of_a_pdl_kernel_passes_the_launch_options():
    kernels = {name for _, name in _pdl_kernels()}
    launches, bad = 0, []
    for path in sorted(KERNELS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)):
                continue
            name = ast.unparse(node.func.value)
            if name not in kernels:
                continue
            launches += 1
            spread = [ast.unparse(k.value) for k in node.keywords if k.arg is None]
            if not any(s.startswith("pdl.options(") for s in spread):
                bad.append(f"{path.stem}: {name}[...] at line {node.lineno}")
    assert launches >= 18
    assert bad == [], "launches without **pdl.options(tensor):\n" + "\n".join(bad)


def test_options_stay_off_on_cpu_and_by_default(monkeypatch):
    from dsv4_kernels import pdl

    x = torch.zeros(4)
    for value in (None, "0", "1"):
        if value is None:
            monkeypatch.delenv(pdl.ENV, raising=False)
        else:
            monkeypatch.setenv(pdl.ENV, value)
        pdl._device_supports.cache_clear()
        assert pdl.options(x) == {"PDL": False}
        assert pdl.enabled(x) is False
    pdl._device_supports.cache_clear()


def test_a_captured_launch_stays_stream_ordered(monkeypatch):
    """Inside CUDA-graph capture the options are off even where PDL is on (graph capture failed
    with programmatic launches: pdl.py's docstring)."""
    from dsv4_kernels import pdl

    monkeypatch.setattr(pdl, "enabled", lambda t: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert pdl.options(torch.zeros(1)) == {"PDL": True, "launch_pdl": True}
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert pdl.options(torch.zeros(1)) == {"PDL": False}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_options_follow_the_switch_on_hopper(monkeypatch):
    from dsv4_kernels import pdl

    x = torch.zeros(4, device="cuda")
    hopper = torch.cuda.get_device_capability()[0] >= 9
    monkeypatch.setenv(pdl.ENV, "1")
    pdl._device_supports.cache_clear()
    assert pdl.options(x) == ({"PDL": True, "launch_pdl": True} if hopper else {"PDL": False})
    with torch.cuda.graph(torch.cuda.CUDAGraph()):  # a captured launch: stream-ordered
        captured = pdl.options(x)
    assert captured == {"PDL": False}
    monkeypatch.setenv(pdl.ENV, "0")
    pdl._device_supports.cache_clear()
    assert pdl.options(x) == {"PDL": False}
    pdl._device_supports.cache_clear()
