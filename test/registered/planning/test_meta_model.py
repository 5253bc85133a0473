"""The meta-device walk the planner and the step cost share lists the model's tensors as a
model built on the CPU holds them: the same names, shapes and bytes, MTP layers included."""

import torch

from sglang.srt.configs.presets import get_preset
from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM
from sglang.srt.planning.meta_model import meta_tensors


def _built(config, dtype):
    model = DeepseekV4ForCausalLM(config, dtype, max_positions=2)
    return {name: (tuple(t.shape), t.numel() * t.element_size())
            for name, t in list(model.named_parameters()) + list(model.named_buffers())}


def test_bf16_tensors_match_a_model_built_on_the_cpu():
    config = get_preset("dsv4-tiny")
    listed = {t.name: (t.shape, t.nbytes) for t in meta_tensors(config, "bfloat16")}
    assert listed == _built(config, torch.bfloat16)
    assert listed["embed.weight"] == ((512, 64), 512 * 64 * 2)


def test_release_format_tensors_count_fp8_and_fp4_storage_as_held():
    config = get_preset("dsv4-tiny-fp8")
    tensors = meta_tensors(config, "bfloat16")
    assert {t.name: (t.shape, t.nbytes) for t in tensors} == _built(config, torch.bfloat16)
    by_name = {t.name: t for t in tensors}
    # dsv4-tiny-fp8: 8 experts, hidden 256, intermediate 128. FP4 experts hold two weights per
    # byte and one e8m0 scale per 32 inputs; FP8 linears one byte per weight.
    assert (by_name["layers.0.ffn.experts.w1"].shape, by_name["layers.0.ffn.experts.w1"].nbytes) == (
        (8, 128, 128), 8 * 128 * 128)
    assert by_name["layers.0.ffn.experts.w1_scale"].nbytes == 8 * 128 * (256 // 32)
    assert by_name["layers.0.ffn.shared_experts.w1.weight"].nbytes == 128 * 256
