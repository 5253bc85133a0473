"""The FP4 MoE backends on CUDA at Flash's expert dims (hidden 4096, inter 2048, top-6): humming
against the reference formula (quant_reference.fp4_moe_ref) and the Triton backend, sharded
experts, replay from a CUDA graph with fresh routing, and the conformance model run through it
eagerly and from a breakable graph. Numbers are printed (run with -s)."""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from sglang.srt.layers.moe.backends import humming_unsupported, make_fp4_backend
from sglang.srt.layers.moe.experts import Fp4RoutedExperts
from sglang.srt.layers.moe.router import route

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

D, I, TOPK, LIMIT = 4096, 2048, 6, 10.0


def _require_humming():
    reason = humming_unsupported("cuda", torch.bfloat16)
    if reason is not None:
        pytest.skip(reason)


def _packed(n, seed):
    from dsv4_kernels import quant_reference as Q

    g = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    for rows, cols in ((I, D), (I, D), (D, I)):
        w = torch.randn(n, rows, cols, device="cuda", generator=g) * cols ** -0.5
        out += list(Q.quantize_fp4(w))
    w1, s1, w3, s3, w2, s2 = out
    return w1, s1, w3, s3, w2, s2


def _experts(packed, n_total, expert_range, act_quant, backend):
    with torch.device("cuda"):
        e = Fp4RoutedExperts(n_total, D, I, LIMIT, act_quant, expert_range, torch.bfloat16)
    for name, t in zip(("w1", "w1_scale", "w3", "w3_scale", "w2", "w2_scale"), packed):
        getattr(e, name).copy_(t.view(getattr(e, name).dtype))
    e.use_backend(make_fp4_backend(backend))
    return e


def _inputs(T, n_total, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, D, generator=g) * 2).bfloat16().cuda()
    w, ids = route(torch.randn(T, n_total, generator=g), TOPK, 2.5, "sqrtsoftplus")
    return x, w.cuda(), ids.cuda()


def _cos(a, b):
    return F.cosine_similarity(a.flatten().float(), b.flatten().float(), dim=0).item()


@pytest.mark.parametrize("act_quant", [True, False], ids=["release", "weight_only"])
@pytest.mark.parametrize("T", [1, 5, 64, 700])
def test_humming_matches_the_reference_formula(act_quant, T):
    """16 experts held of 48 (ids outside the shard skipped, as under EP), every T range's
    kernel configuration: the same sum as fp4_moe_ref, up to humming's bf16 gate/up and expert
    outputs (the reference keeps fp32 there)."""
    _require_humming()
    from dsv4_kernels.quant_reference import fp4_moe_ref

    packed = _packed(16, seed=T)
    ref_experts = _experts(packed, 48, (16, 32), act_quant, "torch")
    hm = _experts(packed, 48, (16, 32), act_quant, "humming")
    assert not hasattr(hm, "w1") and hm.backend.name == "humming"  # packed originals replaced
    x, w, ids = _inputs(T, 48, seed=T + 1)
    ids[:, 0] = 16 + ids[:, 0] % 16  # at least one local expert per token (maybe listed twice:
    ref_experts.may_repeat_ids = hm.may_repeat_ids = False  # then counted twice, as fp4_moe_ref does)
    got = hm(x, w, ids)
    want = ref_experts(x, w, ids)
    direct = fp4_moe_ref(x, *packed, ids - 16, w, LIMIT, act_quant)
    torch.testing.assert_close(want, direct, rtol=1e-5, atol=1e-5 * direct.abs().max().item())
    cos = _cos(got, want)
    err = ((got - want).abs().max() / want.abs().max()).item()
    print(f"humming {'release' if act_quant else 'weight_only'} T={T}: cos {cos:.6f}, max rel err {err:.2e}")
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    assert cos > (0.999 if act_quant else 0.99995)


def test_humming_hands_out_the_rows_before_their_sum_when_asked():
    """defer_sum: humming returns its down GEMM's rows and the local ids (RoutedRows) instead
    of their top-k sum; their sum is the fp32 sum of the shard's rows in top-k order, and
    close to an undeferred call's output. Not equal to it: humming's stream-K GEMMs add the
    slices of a tile with bf16 atomics, so two calls on the same inputs differ (on an H100,
    with humming's own configurations, by up to 0.16 at these dims; the Triton backend's
    repeats are equal). The Triton backend always sums."""
    _require_humming()
    from dsv4_kernels.moe import RoutedRows

    packed = _packed(16, seed=7)
    hm = _experts(packed, 48, (16, 32), True, "humming")
    tri = _experts(packed, 48, (16, 32), True, "triton")
    x, w, ids = _inputs(1, 48, seed=8)
    ids[:, 0] = 16 + ids[:, 0] % 16
    rows = hm(x, w, ids, defer_sum=True)
    assert isinstance(rows, RoutedRows) and rows.partial.shape == (TOPK, D) and rows.num_experts == 16
    local = (rows.ids >= 0) & (rows.ids < 16)
    assert local[0, 0] and not local.all()  # the first pick is this shard's, not every one
    want = torch.zeros(1, D, device="cuda")
    for k in range(TOPK):
        want += torch.where(local[:, k, None], rows.partial[k].float(), 0.0)
    assert torch.equal(rows.sum(), want)
    assert _cos(rows.sum(), hm(x, w, ids)) > 0.999
    assert isinstance(tri(x, w, ids, defer_sum=True), torch.Tensor)


@pytest.mark.parametrize("T", [1, 64, 2048])
def test_humming_agrees_with_triton_at_flash_experts_and_replays_from_a_graph(T):
    """All 256 experts: humming W4A8 beside the Triton backend (release numerics both), then
    captured once and replayed on fresh routing: equal to an eager call on those inputs."""
    _require_humming()
    packed = _packed(256, seed=3)
    tri = _experts(packed, 256, None, True, "triton")
    hm = _experts(packed, 256, None, True, "humming")
    del packed
    bytes_hm = hm.backend.weight_bytes(hm)
    bytes_tri = tri.backend.weight_bytes(tri)
    print(f"expert bytes: humming {bytes_hm / 2**30:.3f} GiB, packed {bytes_tri / 2**30:.3f} GiB")
    assert bytes_hm <= bytes_tri * 1.01 + 2**20  # its layout, not a wider copy
    x, w, ids = _inputs(T, 256, seed=T)
    cos = _cos(hm(x, w, ids), tri(x, w, ids))
    print(f"humming vs triton T={T}: cos {cos:.6f}")
    assert cos > 0.999

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        hm(x, w, ids)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = hm(x, w, ids)
    x2, w2, ids2 = _inputs(T, 256, seed=T + 100)
    x.copy_(x2)
    w.copy_(w2)
    ids.copy_(ids2)
    graph.replay()
    torch.testing.assert_close(static_out, hm(x2, w2, ids2), rtol=0, atol=0)


def test_conformance_model_through_humming_eager_and_bcg(dsv4_reference_dir):
    """conformance-tiny-fp8fp4 in bf16 on CUDA, release numerics, --moe-backend humming: the
    reference rows within the bf16 bound the Triton backend meets in the same run, and a
    breakable-graph replay of the same chunks equal to eager."""
    _require_humming()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    from dsv4_harness import prefill_in_chunks
    from safetensors.torch import load_file

    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.test.runner_args import cpu_server_args

    fixture = dsv4_reference_dir / "conformance-tiny-fp8fp4"
    expected = load_file(str(fixture / "expected.safetensors"))
    prompt = expected["input_ids"].tolist()[:int(expected["n_prompt"][0])]
    ref = expected["logits"][0]

    def runner(backend, breakable):
        return ModelRunner(cpu_server_args(model_path=str(fixture), dtype="bfloat16", device="cuda",
                                           context_length=512, max_total_tokens=2048, quant_numerics="release",
                                           moe_backend=backend, enable_breakable_cuda_graph=breakable,
                                           breakable_cuda_graph_tokens=[128] if breakable else None))

    rows = {}
    for backend, breakable in (("triton", False), ("humming", False), ("humming", True)):
        r = runner(backend, breakable)
        assert r.server_args.moe_backend == backend
        assert r.model.layers[1].ffn.experts.backend.name == backend
        rows[backend, breakable] = torch.stack(prefill_in_chunks(r, prompt, [128, 128, 26])).float().cpu()
        if breakable:  # the two 128-token chunks at least (a short last chunk may run eagerly)
            assert r.get_stats()["breakable_replays"] >= 2
        del r
        torch.cuda.empty_cache()
    for key, got in rows.items():
        print(f"conformance-tiny-fp8fp4 bf16 release, {key}: row 0 cos vs reference "
              f"{F.cosine_similarity(got[-1], ref, dim=0).item():.6f}")
    tri_cos = F.cosine_similarity(rows["triton", False][-1], ref, dim=0).item()
    hm_cos = F.cosine_similarity(rows["humming", False][-1], ref, dim=0).item()
    assert hm_cos > min(0.97, tri_cos - 0.01)
    # the two full 128-token chunks run the same kernels at the same shapes in both
    breakable_vs_eager = F.cosine_similarity(rows["humming", True][:2], rows["humming", False][:2], dim=-1)
    assert breakable_vs_eager.min().item() > 0.999999
