"""fp32 inputs are multiplied in fp32 by every Triton kernel an fp32 model runs (FP8 / FP4
weights decoded exactly, dots with input_precision="ieee"), never in TF32 (Triton's default for
fp32 dots, 10 mantissa bits) or bf16.

Each kernel is compared with an fp64 computation of its formula, normwise: fp32 products and
sums land within ~1e-7 of it, one TF32 or bf16 rounding of the operands at ~1e-4 to 1e-3
(random fp32 inputs have their low mantissa bits set). On a GPU the hardware rounds TF32 dots
itself. Triton's interpreter ignores input_precision (numpy fp32 dots), so under it the
`tf32_dots` fixture rounds the operands of every fp32 dot that asks for TF32 to 10 mantissa
bits, as the tensor cores do: a kernel that leaves an fp32 dot at Triton's default fails here
on a CPU too. The fixture also records each dot's precision, and the tests check which ran.
"""

import os

import pytest
import torch
import torch.nn.functional as F

from dsv4_kernels import quant_reference as Q
from kernel_test_utils import distinct_expert_ids, fp4_experts, require_triton

REL = 2.0 ** -18  # normwise: fp32 rounding is ~2^-23 here, TF32 ~2^-12


@pytest.fixture
def tf32_dots(monkeypatch):
    """Under the interpreter: TF32 dots on fp32 operands round them to TF32 (10 mantissa bits,
    nearest even) as the GPU does; returns the list of (precision, operand dtype) of every dot."""
    seen = []
    if os.environ.get("TRITON_INTERPRET") != "1":
        return seen
    import numpy as np
    from triton.runtime import interpreter

    dot = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        prec = str(input_precision).rsplit(".", 1)[-1].upper()
        seen.append((prec, str(a.dtype.scalar)))
        if prec == "TF32" and a.data.dtype == np.float32:
            a = interpreter.TensorHandle(interpreter._round_f32_to_tf32(a.data), a.dtype.scalar)
            b = interpreter.TensorHandle(interpreter._round_f32_to_tf32(b.data), b.dtype.scalar)
        return dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)
    return seen


def assert_fp32_close(got: torch.Tensor, want64: torch.Tensor):
    err = (got.double().cpu() - want64.cpu()).norm() / want64.norm()
    assert err < REL, f"normwise error {err:.2e} (fp32: < {REL:.1e}; a TF32 rounding is ~1e-4)"


def assert_fp32_dots_were_ieee(seen):
    if seen:  # under the interpreter
        assert all(prec == "IEEE" for prec, dtype in seen if dtype == "fp32"), sorted(set(seen))


def test_the_fixture_makes_a_tf32_dot_detectable(device, tf32_dots):
    """The check itself: an fp32 dot left at TF32 fails assert_fp32_close (emulated under the
    interpreter, the tensor cores' own rounding on a GPU)."""
    require_triton()
    import triton
    import triton.language as tl

    @triton.jit
    def mm(a_ptr, b_ptr, c_ptr, PREC: tl.constexpr):
        r = tl.arange(0, 32)
        a = tl.load(a_ptr + r[:, None] * 32 + r[None, :])
        b = tl.load(b_ptr + r[:, None] * 32 + r[None, :])
        tl.store(c_ptr + r[:, None] * 32 + r[None, :], tl.dot(a, b, input_precision=PREC))

    a, b = torch.randn(32, 32, device=device), torch.randn(32, 32, device=device)
    want = a.double() @ b.double()
    c = torch.empty(32, 32, device=device)
    mm[(1,)](a, b, c, PREC="ieee")
    assert_fp32_close(c, want)
    mm[(1,)](a, b, c, PREC="tf32")
    with pytest.raises(AssertionError, match="normwise error"):
        assert_fp32_close(c, want)


@pytest.mark.parametrize("M", [5, 300])  # 16 x 64 tiles with split-K; 128 x 128 tiles
@pytest.mark.parametrize("act_quant", [False, True])
def test_fp8_block_linear_on_fp32_x(device, tf32_dots, M, act_quant):
    require_triton()
    from dsv4_kernels import fp8_gemm
    N, K = 192, 384
    w, s = Q.quantize_fp8_weight(torch.randn(N, K) / K ** 0.5)
    x = torch.randn(M, K)
    y = fp8_gemm.fp8_block_linear(x.to(device), w.to(device), s.to(device), act_quant)
    xq = Q.fp8_round_blocks(x) if act_quant else x  # FP8 values: exact in fp32 and fp64
    assert y.dtype == torch.float32
    assert_fp32_close(y, xq.double() @ Q.dequantize_fp8_block(w, s).double().t())
    assert_fp32_dots_were_ieee(tf32_dots)


def test_fp8_grouped_linear_on_fp32_x(device, tf32_dots):
    require_triton()
    from dsv4_kernels import fp8_gemm
    T, G, n, K = 3, 2, 128, 256
    w, s = Q.quantize_fp8_weight(torch.randn(G * n, K) / K ** 0.5)
    x = torch.randn(T, G, K)
    y = fp8_gemm.fp8_grouped_linear(x.to(device), w.to(device), s.to(device))
    wd = Q.dequantize_fp8_block(w, s).double().view(G, n, K)
    assert_fp32_close(y, torch.einsum("tgk,gnk->tgn", x.double(), wd))
    assert_fp32_dots_were_ieee(tf32_dots)


def _moe64(x, w1, w3, w2, ids, weights, limit):
    """The routed experts' sum in fp64: W2_e(silu(min(W1_e x, L)) * clamp(W3_e x, -L, L) * w)."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if 0 <= e < w1.shape[0]:
                g, u = w1[e] @ x[t], w3[e] @ x[t]
                h = F.silu(g.clamp(max=limit)) * u.clamp(-limit, limit) * weights[t, k]
                out[t] += w2[e] @ h
    return out


# 2 tokens x top-2: one dot per 32-input chunk; 64 tokens: one dot per 128-input step with the
# pair decode (moe_config's tiers; the conformance model's prefill takes the second)
@pytest.mark.parametrize("T", [2, 64])
def test_fp4_moe_weight_only_on_fp32_x(device, tf32_dots, T):
    require_triton()
    from dsv4_kernels import fp4_moe
    E, d, inter, topk, limit = 4, 256, 128, 2, 10.0
    ws = fp4_experts(E, d, inter, device)
    x = torch.randn(T, d)
    ids = distinct_expert_ids(T, topk, 0, E, "cpu")
    weights = torch.rand(T, topk)
    assert bool(fp4_moe.moe_config(T, topk, torch.float32).get("step_dot")) == (T == 64)
    out = fp4_moe.fp4_fused_moe(x.to(device), *ws, ids.to(device), weights.to(device), limit,
                                torch.empty(T, d, device=device), False)
    dq = [Q.dequantize_fp4(ws[i].cpu(), ws[i + 1].cpu()).double() for i in (0, 2, 4)]
    assert_fp32_close(out, _moe64(x.double(), *dq, ids, weights.double(), limit))
    assert_fp32_dots_were_ieee(tf32_dots)


def test_bf16_weight_moe_on_fp32_x(device, tf32_dots):
    require_triton()
    from dsv4_kernels import moe
    E, d, inter, T, topk, limit = 4, 128, 64, 6, 2, 10.0
    w1, w3 = torch.randn(E, inter, d) / d ** 0.5, torch.randn(E, inter, d) / d ** 0.5
    w2 = torch.randn(E, d, inter) / inter ** 0.5
    x = torch.randn(T, d)
    ids = distinct_expert_ids(T, topk, 0, E, "cpu")
    weights = torch.rand(T, topk)
    out = moe.fused_moe(*(t.to(device) for t in (x, w1, w3, w2, ids, weights)), limit,
                        torch.empty(T, d, device=device))
    want = _moe64(x.double(), w1.double(), w3.double(), w2.double(), ids, weights.double(), limit)
    assert_fp32_close(out, want)
    assert_fp32_dots_were_ieee(tf32_dots)


def test_indexer_logits_on_fp32_q(device, tf32_dots):
    require_triton()
    from dsv4_kernels import indexer
    T, H, D, C, slots = 3, 16, 128, 40, 64
    q, keys = torch.randn(T, H, D), torch.randn(slots, D)
    w = torch.randn(T, H)
    cand = torch.randint(0, slots, (T, C), dtype=torch.int32)
    lens = torch.full((T,), C, dtype=torch.int32)
    got = indexer.indexer_logits(q.to(device), w.to(device), keys.to(device), cand.to(device),
                                 lens.to(device))
    dots = torch.einsum("thd,tcd->thc", q.double(), keys.double()[cand.long()]).relu()
    assert_fp32_close(got, torch.einsum("th,thc->tc", w.double(), dots))
    assert_fp32_dots_were_ieee(tf32_dots)


def test_hc_pre_on_fp32_x(device, tf32_dots):
    """The mHC mixes of fp32 residual copies: fp32 products (the reference's fp32 linear is the
    comparison: its own rounding is ~1e-7 normwise, far inside REL)."""
    require_triton()
    from dsv4_kernels import mhc, reference
    T, hc, d, mix = 20, 4, 128, 24
    x = torch.randn(T, hc, d) * 2 + 0.3
    fn = torch.randn(mix, hc * d) * (1.5 / (hc * d) ** 0.5)
    scale, base = torch.rand(3) + 0.5, torch.randn(mix) * 0.5
    got = mhc.hc_pre(*(t.to(device) for t in (x, fn, scale, base)), hc, 20, 1e-6, 1e-6)
    want = reference.hc_pre(x, fn, scale, base, hc, 20, 1e-6, 1e-6)
    for g, w in zip(got, want):
        assert_fp32_close(g, w.double())
    assert_fp32_dots_were_ieee(tf32_dots)


@pytest.mark.parametrize("num_splits", [1, 2])
def test_sparse_attention_on_fp32_q(device, tf32_dots, num_splits):
    """q . k and p . v in fp32 (against the torch reference's fp32: ~1e-7 normwise)."""
    require_triton()
    from dsv4_kernels import reference
    from dsv4_kernels.sparse_attention import SparseAttnConfig, sparse_attn_with_sink
    from kernel_test_utils import random_index_lists
    T, H, D, S = 4, 16, 128, 90
    q, kv = torch.randn(T, H, D), torch.randn(S, D)
    idx, lens = random_index_lists(T, 48, S, [48, 20, 33, 1])
    sink = torch.randn(H)
    want = reference.sparse_attn_with_sink(q, kv, idx, lens, None, None, None, sink, D ** -0.5,
                                           torch.empty_like(q))
    out = torch.empty(T, H, D, device=device)
    sparse_attn_with_sink(q.to(device), kv.to(device), idx.to(device), lens.to(device), None, None,
                          None, sink.to(device), D ** -0.5, out, SparseAttnConfig(num_splits=num_splits))
    assert_fp32_close(out, want.double())
    assert_fp32_dots_were_ieee(tf32_dots)
