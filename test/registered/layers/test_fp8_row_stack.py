"""Fp8RowStack: FP8 block linears on one input as rows of one weight tensor. On CPU the
re-layout holds every linear's values in shared storage and the release-format model's logits
do not move; on a GPU a decode row through NormedInput takes one GEMV for the stack and each
linear's columns equal its own GEMV bit for bit, and up to 64 rows take one GEMM whose columns
are each linear's product."""

import pytest
import torch

from sglang.srt.configs.presets import dsv4_tiny_fp8_dims, release_format
from sglang.srt.layers.layernorm import NormedInput, RMSNorm
from sglang.srt.layers.quantization.fp8_linear import Fp8BlockLinear, Fp8RowStack
from sglang.srt.model_loader.random_init import init_random_weights
from sglang.srt.models.deepseek_v4 import DeepseekV4Attention, DeepseekV4ForCausalLM


def _linear(k, n, seed, device="cpu", act_quant=True):
    g = torch.Generator().manual_seed(seed)
    lin = Fp8BlockLinear(k, n, act_quant).to(device)
    lin.weight.data.copy_((torch.randn(n, k, generator=g) * 0.5).to(torch.float8_e4m3fn))
    lin.weight_scale.data.copy_(2.0 ** torch.randint(-8, -4, lin.weight_scale.shape, generator=g).float())
    return lin


def test_the_stack_keeps_each_linear_s_values_in_one_storage():
    a, b = _linear(256, 128, 0), _linear(256, 200, 1)
    x = torch.randn(3, 256)
    want = a(x), b(x)
    before = a.weight.data.clone(), b.weight_scale.data.clone()
    stack = Fp8RowStack([a, b])
    assert a.weight.untyped_storage().data_ptr() == b.weight.untyped_storage().data_ptr() == \
        stack.weight.untyped_storage().data_ptr()
    assert stack.weight.shape == (328, 256) and stack.weight_scale.shape == (3, 2)
    assert torch.equal(a.weight.view(torch.uint8), before[0].view(torch.uint8))
    assert torch.equal(b.weight_scale, before[1])
    assert torch.equal(a(x), want[0]) and torch.equal(b(x), want[1])
    assert stack.columns[a] == (0, 128) and stack.columns[b] == (128, 328)
    assert not Fp8RowStack.stackable([a, b])  # stacked already: a repeated call changes nothing


def test_the_stack_called_gives_every_linear_s_output_side_by_side():
    a, b = _linear(256, 128, 0), _linear(256, 200, 1)
    x = torch.randn(4, 256)
    want = torch.cat([a(x), b(x)], dim=1)
    assert torch.equal(Fp8RowStack([a, b])(x), want)


def test_only_linears_of_one_input_with_whole_blocks_stack():
    assert not Fp8RowStack.stackable([_linear(256, 200, 0), _linear(256, 128, 1)])  # 200 rows: a partial block
    assert not Fp8RowStack.stackable([_linear(256, 128, 0), _linear(384, 128, 1)])
    assert not Fp8RowStack.stackable([_linear(256, 128, 0), _linear(256, 128, 1, act_quant=False)])
    assert not Fp8RowStack.stackable([_linear(256, 128, 0), torch.nn.Linear(256, 128, bias=False)])
    with pytest.raises(ValueError, match="whole 128-row blocks"):
        Fp8RowStack([_linear(256, 200, 0), _linear(256, 128, 1)])


def test_a_release_format_model_stacks_its_attention_inputs_and_keeps_its_logits():
    config = release_format(dsv4_tiny_fp8_dims())
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(config, torch.float32, max_positions=64)
    init_random_weights(model, 0)
    attns = [m for m in model.modules() if isinstance(m, DeepseekV4Attention)]
    x = torch.randn(5, config.hidden_size)
    want = [(m.wq_a(x), m.wkv(x)) for m in attns]
    model.stack_input_linears()
    for m, (qa, kv) in zip(attns, want):
        assert m.wq_a.row_stack is m.wkv.row_stack
        assert torch.equal(m.wq_a(x), qa) and torch.equal(m.wkv(x), kv)
        if m.ratio == 4:
            assert m.wq_b.row_stack is m.indexer.wq_b.row_stack is not m.wq_a.row_stack
        else:
            assert getattr(m.wq_b, "row_stack", None) is None


@pytest.mark.gpu
@pytest.mark.parametrize("norm", [False, True])
def test_gpu_a_decode_row_through_the_stack_equals_each_linear_s_gemv(norm):
    from sglang.srt.model_executor.forward_context import forward_context
    from sglang.test.ep_harness import _KernelsSwitch

    K = 1024
    a, b = _linear(K, 1024, 0, "cuda"), _linear(K, 512, 1, "cuda")
    rms = RMSNorm(K, 1e-6).cuda() if norm else None
    if rms is not None:
        rms.weight.data.uniform_(0.5, 1.5)
    x = torch.randn(1, K, device="cuda").bfloat16()
    with forward_context(None, _KernelsSwitch(True), num_live_tokens=1):
        want = NormedInput(x, rms).through(a), NormedInput(x, rms).through(b)
        Fp8RowStack([a, b])
        shared = NormedInput(x, rms)
        got = shared.through(a), shared.through(b)
    assert len(shared._stacked) == 1  # one GEMV for both
    assert got[0].is_contiguous() and got[1].is_contiguous()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [2, 16, 64])
@pytest.mark.parametrize("norm", [False, True])
def test_gpu_small_batches_take_one_gemm_for_the_stack(rows, norm):
    """2..64 rows: one Triton GEMM for the stack (its split-K follows the stack's width, so a
    part may differ from its linear alone in the order of fp32 sums: within a bf16 step); each
    linear's columns a view at the stack's row stride; 65 rows take each linear alone."""
    from sglang.srt.model_executor.forward_context import forward_context
    from sglang.test.ep_harness import _KernelsSwitch

    K = 1024
    a, b = _linear(K, 1024, 0, "cuda"), _linear(K, 512, 1, "cuda")
    rms = RMSNorm(K, 1e-6).cuda() if norm else None
    if rms is not None:
        rms.weight.data.uniform_(0.5, 1.5)
    x = torch.randn(rows, K, device="cuda").bfloat16()
    with forward_context(None, _KernelsSwitch(True), num_live_tokens=rows):
        want = NormedInput(x, rms).through(a), NormedInput(x, rms).through(b)
        Fp8RowStack([a, b])
        shared = NormedInput(x, rms)
        got = shared.through(a), shared.through(b)
        big = NormedInput(torch.randn(65, K, device="cuda").bfloat16(), rms)
        big.through(a)
    assert len(shared._stacked) == 1 and not big._stacked
    assert got[0].stride() == (1536, 1) and got[1].stride() == (1536, 1)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float(), w.float(), rtol=2 ** -7, atol=1e-3)
