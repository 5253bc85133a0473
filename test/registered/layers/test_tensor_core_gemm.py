"""fp32 GEMMs on bf16 tensor cores (layers/tensor_core_gemm.py), checked on CPU: the two-term
bf16 split of an fp32 weight against an fp64 product within its stated bound, the fused wkv |
wgate operand, wo_a's bf16 dequantization (bit-exact) and grouped product (the fp32 einsum's
result), and a bf16 dsv4-tiny whose layers take these paths (on CPU their fp32-accumulating
GEMMs are the upcast ones) against the same model on the fp32 GEMMs."""

import dataclasses
import importlib
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from dsv4_harness import Session, prefill_in_chunks, run_step  # noqa: E402

from dsv4_kernels import quant_reference as Q  # noqa: E402
from sglang.srt.configs.presets import get_preset  # noqa: E402
from sglang.srt.configs.presets import write_config  # noqa: E402
from sglang.srt.layers import tensor_core_gemm as tc  # noqa: E402
from sglang.srt.layers.attention.dsv4.compressor import SPLIT_TERMS, Compressor  # noqa: E402
from sglang.srt.layers.quantization.fp8_linear import Fp8BlockLinear  # noqa: E402
from sglang.srt.planning.memory_planner import tensor_core_copy_bytes  # noqa: E402
from sglang.srt.model_executor.model_runner import ModelRunner  # noqa: E402
from sglang.test.runner_args import cpu_server_args  # noqa: E402


pytestmark = pytest.mark.usefixtures("single_intra_op_thread")


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _spread_weight(n, k, seed):
    """fp32 weights over five decades of magnitude (compressor weights are not all alike)."""
    g = _gen(seed)
    return torch.randn(n, k, generator=g) * 10.0 ** (torch.rand(n, k, generator=g) * 5 - 4)


def _bound(x, w, rel):
    """Elementwise error bound of x @ w.T for per-weight relative error `rel` plus fp32
    accumulation over K: (rel + K * 2^-24) * (|x| @ |w|.T), in fp64."""
    k = x.shape[-1]
    return (rel + k * 2.0 ** -24) * (x.double().abs() @ w.double().abs().T)


def test_split_terms_reconstruct_the_weight():
    w = _spread_weight(64, 96, seed=0)
    hi, lo = tc.split_bf16(w, terms=2)
    assert hi.dtype == lo.dtype == torch.bfloat16
    assert torch.equal(hi, w.to(torch.bfloat16))
    err = (w.double() - hi.double() - lo.double()).abs()
    assert (err <= tc.split_rel_error(2) * w.double().abs()).all()
    # the low half carries real information: bf16 alone is 2^-8-relative
    assert (w.double() - hi.double()).abs().max() > 100 * err.max()
    # three terms hold the 24 significant bits of fp32 exactly
    parts = tc.split_bf16(w, terms=3)
    assert torch.equal(parts[0], hi) and torch.equal(parts[1], lo)
    assert torch.equal(sum(p.double() for p in parts), w.double())
    assert torch.equal(tc.merge_split(tc.split_weight([w], 3), 3), w)  # and back in fp32, bit for bit
    with pytest.raises(TypeError, match="fp32 weight"):
        tc.split_bf16(w.to(torch.bfloat16))
    with pytest.raises(ValueError, match="terms must be 2 or 3"):
        tc.split_bf16(w, terms=4)


@pytest.mark.parametrize("terms", [2, 3])
def test_split_linear_matches_the_fp64_product_within_the_split_bound(terms):
    x = (torch.randn(48, 256, generator=_gen(1)) * 3).to(torch.bfloat16)  # a bf16 activation
    w = _spread_weight(80, 256, seed=2)
    w_split = tc.split_weight([w], terms)
    assert w_split.shape == (80, terms * 256) and w_split.dtype == torch.bfloat16
    got = tc.split_linear(x, w_split)
    assert got.dtype == torch.float32 and got.shape == (48, 80)
    want = x.double() @ w.double().T
    err = (got.double() - want).abs()
    bound = _bound(x, w, tc.split_rel_error(terms))
    assert (err <= bound).all(), f"worst error / bound {(err / bound).max().item():.3f}"
    # the bound is tight enough to tell: the high term alone breaks it by far
    hi_only = x.double() @ w.to(torch.bfloat16).double().T
    assert ((hi_only - want).abs() / bound).max() > 10
    # and three terms are as close as the fp32 GEMM itself
    if terms == 3:
        fp32 = (x.float() @ w.T).double()
        assert err.max() <= 2 * (fp32 - want).abs().max()


def test_fused_projection_is_the_concatenation_of_the_two():
    x = torch.randn(16, 128, generator=_gen(3)).to(torch.bfloat16)
    wkv, wgate = _spread_weight(64, 128, seed=4), _spread_weight(64, 128, seed=5)
    fused = tc.split_linear(x, tc.split_weight([wkv, wgate], 3))
    assert torch.equal(fused[:, :64], tc.split_linear(x, tc.split_weight([wkv], 3)))
    assert torch.equal(fused[:, 64:], tc.split_linear(x, tc.split_weight([wgate], 3)))


def test_split_linear_refuses_mismatched_operands():
    x = torch.randn(4, 32).to(torch.bfloat16)
    w = tc.split_weight([torch.randn(8, 32)])
    with pytest.raises(TypeError, match="bf16 x"):
        tc.split_linear(x.float(), w)
    with pytest.raises(ValueError, match="K=24"):
        tc.split_linear(x[:, :24], w)
    with pytest.raises(TypeError, match="share a bf16/fp16 dtype"):
        tc.mm_fp32(x, w.float().t())


@pytest.mark.parametrize("n,k", [(256, 384), (200, 72)])  # whole 128-blocks, and ragged edges
def test_fp8_dequantization_to_bf16_is_exact(n, k):
    q, s = Q.quantize_fp8_weight(_spread_weight(n, k, seed=6))
    assert Q.scales_are_pow2(s)
    bf16 = Q.dequantize_fp8_block(q, s, torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and bf16.shape == (n, k)
    assert torch.equal(bf16.float(), Q.dequantize_fp8_block(q, s))
    # the fp32 result is unchanged by the broadcast form: e4m3 value times its block's scale
    ref = q.float() * s.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    assert torch.equal(Q.dequantize_fp8_block(q, s), ref)


def test_scales_are_pow2_rejects_other_scales():
    assert Q.scales_are_pow2(torch.tensor([[2.0 ** -9, 1.0, 2.0 ** 5]]))
    assert not Q.scales_are_pow2(torch.tensor([[2.0 ** -9, 0.3]]))
    assert not Q.scales_are_pow2(torch.tensor([[0.0, 1.0]]))
    assert not Q.scales_are_pow2(torch.tensor([[-1.0, 1.0]]))


def _accumulation_bound(o, w):
    """fp32 accumulation bound of einsum("tgd,grd->tgr"): D * 2^-24 * (|o| . |w|), in fp64."""
    return o.shape[-1] * 2.0 ** -24 * torch.einsum("tgd,grd->tgr", o.double().abs(), w.double().abs())


def test_grouped_bf16_einsum_equals_the_fp32_einsum_rounded_once():
    """wo_a: bf16 o times the bf16-dequantized FP8 weight, fp32 accumulation, one rounding to bf16
    == the fp32 einsum of the same values: equal but for summation order (<= 1 bf16 ulp)."""
    G, R, D, T = 2, 128, 256, 24
    lin = Fp8BlockLinear(D, G * R, act_quant=False)
    q, s = Q.quantize_fp8_weight(torch.randn(G * R, D, generator=_gen(7)) * 0.05)
    lin.weight.data.copy_(q)
    lin.weight_scale.data.copy_(s)
    o = torch.randn(T, G, D, generator=_gen(8)).to(torch.bfloat16)
    got = tc.grouped_bf16_einsum(o, lin.dequantized(torch.bfloat16).view(G, R, D))
    want = torch.einsum("tgd,grd->tgr", o.float(), lin.dequantized().view(G, R, D)).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == (T, G, R) and got.is_contiguous()
    # both are one bf16 rounding of an fp32 sum: at most one bf16 ulp apart, plus accumulation
    acc = _accumulation_bound(o, lin.dequantized().view(G, R, D))
    assert ((got.double() - want.double()).abs() <= want.double().abs() * 2.0 ** -7 + 2 * acc).all()
    assert (got == want).float().mean() > 0.95
    # and within one bf16 rounding plus fp32 accumulation of the fp64 product
    exact = torch.einsum("tgd,grd->tgr", o.double(), lin.dequantized().view(G, R, D).double())
    assert ((got.double() - exact).abs() <= exact.abs() * 2.0 ** -8 + acc).all()


def test_fp8_grouped_forward_is_the_grouped_einsum_without_a_dequantized_weight():
    """wo_a at decode sizes: one weight-only FP8 GEMM per group (torch reference on CPU) gives
    the grouped einsum's result up to summation order."""
    G, R, D, T = 2, 128, 256, 8
    lin = Fp8BlockLinear(D, G * R, act_quant=False)
    q, s = Q.quantize_fp8_weight(torch.randn(G * R, D, generator=_gen(12)) * 0.05)
    lin.weight.data.copy_(q)
    lin.weight_scale.data.copy_(s * torch.tensor([[1.0], [4.0]]))  # the groups' scales differ
    o = torch.randn(T, G, D, generator=_gen(13)).to(torch.bfloat16)
    got = lin.grouped_forward(o)
    want = torch.einsum("tgd,grd->tgr", o.float(), lin.dequantized().view(G, R, D)).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == (T, G, R)
    acc = _accumulation_bound(o, lin.dequantized().view(G, R, D))
    assert ((got.double() - want.double()).abs() <= want.double().abs() * 2.0 ** -7 + 2 * acc).all()
    assert (got == want).float().mean() > 0.95
    with pytest.raises(ValueError, match="whole 128-row blocks per group"):
        lin.grouped_forward(o.view(T, 4, D // 2))


def test_only_bf16_models_on_cuda_are_eligible():
    # on a machine without CUDA the capability probe says no instead of raising
    assert tc.tensor_core_eligible(torch.bfloat16, torch.device("cuda", 0)) == torch.cuda.is_available()
    assert not tc.tensor_core_eligible(torch.bfloat16, torch.device("cpu"))
    assert not tc.tensor_core_eligible(torch.float32, torch.device("cuda"))
    assert not tc.tensor_core_eligible(torch.float16, torch.device("cuda"))


def test_flash_tensor_core_copies_add_0_57_gib_per_gpu_and_none_in_fp32():
    flash = get_preset("dsv4-flash")  # 21 c4 layers (compressor + indexer), 20 c128, the MTP layer not run
    per_c4 = 2 * (2 * 512 + 2 * 128) * 4096  # wkv + wgate elements
    per_c128 = 2 * 512 * 4096
    assert SPLIT_TERMS == 3  # three bf16 terms (6 B) replace the fp32 weight (4 B)
    assert tensor_core_copy_bytes(flash, "bfloat16") == (21 * per_c4 + 20 * per_c128) * 2
    assert 0.55 * 2**30 < tensor_core_copy_bytes(flash, "bfloat16") < 0.6 * 2**30
    assert tensor_core_copy_bytes(flash, "float32") == 0


# ---- the LM head -----------------------------------------------------------------------------


def test_lm_head_runs_bf16_only_when_the_bf16_copy_is_exact():
    from sglang.srt.model_loader.random_init import init_random_weights
    from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM

    model = DeepseekV4ForCausalLM(get_preset("dsv4-tiny"), torch.bfloat16, max_positions=64)
    init_random_weights(model, seed=5)
    w = model.head.weight.detach().clone()
    assert not torch.equal(w.to(torch.bfloat16).float(), w)  # a bf16 config's random head is fp32-only
    hidden = torch.randn(7, w.shape[1], generator=_gen(6)).to(torch.bfloat16)
    model._use_bf16_head(True)
    assert model.head_bf16 is None and torch.equal(model.head.weight, w)  # kept: the copy would round it

    model.head.weight.copy_(w.to(torch.bfloat16))  # a release head: BF16 values
    w_bf16 = model.head.weight.detach().clone()
    fp32_logits = model.compute_logits(hidden)
    model._use_bf16_head(True)
    model._use_bf16_head(True)  # a second call keeps it
    assert model.head_bf16.dtype == torch.bfloat16 and model.head.weight.numel() == 0  # 2 bytes, not 4
    torch.testing.assert_close(model.compute_logits(hidden), fp32_logits, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(model.compute_logits(hidden.float()), fp32_logits, rtol=1e-6, atol=1e-6)
    model._use_bf16_head(False)  # back: the fp32 weight bit for bit
    assert model.head_bf16 is None and torch.equal(model.head.weight, w_bf16)


def test_release_format_random_heads_are_bf16_values():
    from sglang.srt.model_loader.random_init import init_random_weights
    from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM

    model = DeepseekV4ForCausalLM(get_preset("dsv4-tiny-fp8"), torch.bfloat16, max_positions=64)
    init_random_weights(model, seed=5)
    w = model.head.weight
    assert w.dtype == torch.float32 and torch.equal(w.to(torch.bfloat16).float(), w)
    assert 0.5 < w.std().item() * w.shape[1] ** 0.5 < 2  # drawn, not a constant


# ---- the model on these paths ---------------------------------------------------------------


def _bf16_tiny_runner(model_path, numerics):
    return ModelRunner(cpu_server_args(model_path=model_path, dtype="bfloat16", device="cpu", context_length=512,
                                       max_total_tokens=1024, max_running_requests=4, disable_cuda_graph=True,
                                       quant_numerics=numerics, load_format="dummy"))


def _all_logits(runner, tokens):
    s = Session(runner)
    out = run_step(runner, [s], [tokens], return_all_logits=True)
    s.release()
    return out.all_logits.float()


def _model_path(name, tmp_path):
    """A preset, or "dsv4-tiny-fp8-o128": dsv4-tiny-fp8 with whole 128-row wo_a groups (its
    decode steps take FP8 wo_a's grouped GEMM)."""
    if name != "dsv4-tiny-fp8-o128":
        return name
    c = get_preset("dsv4-tiny-fp8")
    write_config(dataclasses.replace(c, o_lora_rank=128, extra=dict(c.extra)), str(tmp_path))
    return str(tmp_path)


# A bf16 model rounds activations (and, in release numerics, FP8 / FP4-rounds them) and picks
# top-k entries: any change of summation order flips a few of those decisions. Computing only
# the compressor projections exactly (fp64) instead of by the CPU's fp32 GEMM gives the same
# min cosine as the tensor-core paths in both cases that fall below 0.9999: dsv4-tiny-fp8
# release 0.9968 and dsv4-tiny-fp8-o128 0.9852 (three positions after one c4 top-k flip), so
# those bounds are those of reordering, not of bf16 products; 90% must stay above 0.999.
@pytest.mark.parametrize("preset,numerics,min_cos", [("dsv4-tiny", "weight_only", 0.9999),
                                                     ("dsv4-tiny-fp8", "weight_only", 0.9999),
                                                     ("dsv4-tiny-fp8", "release", 0.99),
                                                     ("dsv4-tiny-fp8-o128", "weight_only", 0.98)])
def test_bf16_model_on_the_tensor_core_paths_matches_the_fp32_gemms(preset, numerics, min_cos, monkeypatch,
                                                                    tmp_path):
    """A bf16 model keeps the fp32 GEMMs on CPU; with eligibility forced, its layers take the
    tensor-core code paths (split compressor projections, bf16 grouped wo_a or, at decode sizes,
    FP8 wo_a's grouped GEMM, fp32-output router logits), whose CPU GEMMs accumulate the same
    products in fp32: the logits must stay those of the fp32 GEMMs up to summation order."""
    runner = _bf16_tiny_runner(_model_path(preset, tmp_path), numerics)
    model = runner.model
    attn = [layer.attn for layer in model.layers]
    compressors = [m for m in model.layers.modules() if isinstance(m, Compressor)]
    assert compressors and not any(a.wo_a_tensor_cores for a in attn)  # CPU: the post-load step kept fp32
    assert all(c.proj_split is None for c in compressors)
    tokens = torch.randint(2, 512, (150,), generator=_gen(9)).tolist()
    fp32_gemms = _all_logits(runner, tokens)
    fp32_decode = torch.stack(prefill_in_chunks(runner, tokens[:6], [1]))

    for mod in ("sglang.srt.layers.attention.dsv4.compressor", "sglang.srt.models.deepseek_v4",
                "sglang.srt.layers.moe.router"):
        monkeypatch.setattr(f"{mod}.tensor_core_eligible", lambda dtype, device: dtype == torch.bfloat16)
    # the 150-token prefill above the FP8 per-group wo_a threshold, the decode steps below it
    monkeypatch.setattr("sglang.srt.models.deepseek_v4.WO_A_FP8_GEMM_MAX_TOKENS", 128)
    calls = {}  # the paths must be taken, not just enabled

    def counted(owner, name):
        fn = getattr(owner, name)

        def wrapper(*args):
            calls[name] = calls.get(name, 0) + 1
            return fn(*args)
        monkeypatch.setattr(owner, name, wrapper)

    counted(importlib.import_module("sglang.srt.layers.attention.dsv4.compressor"), "split_linear")
    counted(importlib.import_module("sglang.srt.models.deepseek_v4"), "grouped_bf16_einsum")
    counted(importlib.import_module("sglang.srt.layers.moe.router"), "mm_fp32")
    counted(Fp8BlockLinear, "grouped_forward")
    masters = {name: p.clone() for name, p in model.layers.named_parameters()
               if "compressor." in name and name.endswith(("wkv.weight", "wgate.weight"))}
    model.use_tensor_core_gemms()
    model.use_tensor_core_gemms()  # a second call keeps the split (the fp32 weights are gone)
    assert all(a.wo_a_tensor_cores for a in attn)
    assert all(c.proj_split is not None and c.proj_split.shape[1] == SPLIT_TERMS * c.wkv.in_features
               for c in compressors)
    assert all(layer.ffn.gate.tensor_core_logits for layer in model.layers)
    # release-format dummy heads are BF16 values (as the release's), so they go bf16 too
    assert (model.head_bf16 is not None) == runner.config.is_quantized
    # the fp32 weights are released (the terms hold them) and the planner counts the difference
    assert all(c.wkv.weight.numel() == c.wgate.weight.numel() == 0 for c in compressors)
    derived = sum(c.proj_split.numel() * c.proj_split.element_size() for c in compressors)
    released = sum(w.numel() * 4 for w in masters.values())
    assert tensor_core_copy_bytes(runner.config, "bfloat16") == derived - released
    tensor_cores = _all_logits(runner, tokens)
    n_layers = len(model.layers)
    assert calls == {"split_linear": len(compressors), "grouped_bf16_einsum": n_layers, "mm_fp32": n_layers}
    calls.clear()
    tensor_core_decode = torch.stack(prefill_in_chunks(runner, tokens[:6], [1]))
    fp8_groups = preset == "dsv4-tiny-fp8-o128"
    assert all(a.wo_a_fp8_groups == fp8_groups for a in attn)
    assert calls.get("grouped_forward", 0) == (6 * n_layers if fp8_groups else 0)
    assert calls.get("grouped_bf16_einsum", 0) == (0 if fp8_groups else 6 * n_layers)

    cos = F.cosine_similarity(tensor_cores, fp32_gemms, dim=-1)
    dcos = F.cosine_similarity(tensor_core_decode, fp32_decode, dim=-1)
    diff = (tensor_cores - fp32_gemms).abs().max().item()
    print(f"[{preset} bf16 {numerics}, CPU] tensor-core paths vs fp32 GEMMs: min cosine {cos.min().item():.6f}, "
          f"max |diff| {diff:.3e}, logit std {fp32_gemms.std().item():.3f}; decode min cosine "
          f"{dcos.min().item():.6f}")
    assert cos.min() > min_cos and dcos.min() > min_cos
    assert (cos > 0.999).float().mean() > 0.9
    assert (tensor_cores.argmax(-1) == fp32_gemms.argmax(-1)).float().mean() > 0.97

    model.use_tensor_core_gemms(False)  # and back: the fp32 weights bit for bit, the fp32 GEMMs' logits
    assert not any(a.wo_a_tensor_cores for a in attn) and all(c.proj_split is None for c in compressors)
    assert model.head_bf16 is None
    restored = dict(model.layers.named_parameters())
    assert all(torch.equal(restored[name], w) for name, w in masters.items())
    assert torch.equal(_all_logits(runner, tokens), fp32_gemms)
