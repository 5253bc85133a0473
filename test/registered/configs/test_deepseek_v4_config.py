"""DeepseekV4Config: real release configs load unchanged, presets are well-formed, bad configs
fail with an error that names the field."""

import json

import pytest

from sglang.srt.configs.deepseek_v4 import ConfigError, DeepseekV4Config, estimate_num_parameters
from sglang.srt.configs.loader import load_model_config
from sglang.srt.configs.presets import PRESETS, get_preset


def test_real_pro_config_loads_with_its_values(dsv4_reference_dir):
    c = load_model_config(str(dsv4_reference_dir / "DeepSeek-V4-Pro.config.json"))
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.head_dim) == (7168, 61, 128, 512)
    assert c.nope_head_dim == 448
    assert len(c.compress_ratios) == 62  # 61 layers + 1 MTP layer
    assert c.layer_compress_ratio(0) == 128
    assert c.layer_compress_ratio(2) == 4
    assert c.layer_compress_ratio(60) == 4  # last main layer
    assert c.layer_compress_ratio(61) == 0  # the MTP layer
    assert c.fp8_weight_block_size == (128, 128)
    assert c.rope_factor == 16.0 and c.original_max_position_embeddings == 65536
    assert (c.beta_fast, c.beta_slow) == (32.0, 1.0)
    assert c.rope_theta == 10000.0 and isinstance(c.rope_theta, float)
    assert c.num_hash_layers == 3 and c.is_hash_layer(2) and not c.is_hash_layer(3)
    assert c.expert_dtype == "fp4" and c.routed_scaling_factor == 2.5
    assert c.extra["hidden_act"] == "silu" and c.extra["use_cache"] is True
    with pytest.raises(IndexError):
        c.layer_compress_ratio(62)


def test_conformance_tiny_config_loads_from_its_directory(dsv4_reference_dir):
    c = load_model_config(str(dsv4_reference_dir / "conformance-tiny"))
    assert [c.layer_compress_ratio(i) for i in range(4)] == [0, 4, 128, 4]
    assert c.num_nextn_predict_layers == 1 and c.layer_compress_ratio(4) == 0
    assert (c.sliding_window, c.index_topk, c.hidden_size) == (8, 4, 128)


def test_parameter_count_matches_the_conformance_checkpoint(dsv4_reference_dir):
    # 1833733 = elements of every non-MTP tensor in conformance-tiny/model.safetensors.
    c = load_model_config(str(dsv4_reference_dir / "conformance-tiny"))
    assert estimate_num_parameters(c) == 1833733


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_loads_by_name_with_every_layer_type(name):
    c = load_model_config(name)
    assert set(c.compress_ratios) == {0, 4, 128}
    assert len(c.compress_ratios) == c.num_hidden_layers + (1 if name == "dsv4-flash" else 0)
    assert c.num_hash_layers >= 1 and c.is_hash_layer(0) and not c.is_hash_layer(c.num_hash_layers)
    assert c.rope_scaling["type"] == "yarn" and (c.beta_fast, c.beta_slow) == (32.0, 1.0)
    assert (c.hc_mult, c.hc_sinkhorn_iters, c.swiglu_limit) == (4, 20, 10.0)
    assert load_model_config(name) is not c  # fresh object each time


def test_tiny_preset_dims():
    c = get_preset("dsv4-tiny")
    assert (c.sliding_window, c.index_topk, c.compress_ratios) == (8, 4, [0, 4, 128, 4])
    assert (c.hidden_size, c.head_dim, c.nope_head_dim, c.vocab_size) == (64, 64, 48, 512)
    assert c.rope_factor == 4.0 and c.original_max_position_embeddings == 256


def test_flash_slice_preset_has_flash_layer_dims():
    c = get_preset("dsv4-flash-slice")
    assert (c.hidden_size, c.num_attention_heads, c.head_dim, c.qk_rope_head_dim) == (4096, 64, 512, 64)
    assert (c.q_lora_rank, c.o_groups, c.o_lora_rank) == (1024, 8, 1024)
    assert (c.num_experts_per_tok, c.moe_intermediate_size, c.vocab_size) == (6, 2048, 129280)
    assert (c.index_n_heads, c.index_head_dim, c.index_topk, c.sliding_window) == (64, 128, 512, 128)


def test_preset_parameter_count_matches_the_model():
    import torch
    from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM

    config = get_preset("dsv4-tiny")
    model = DeepseekV4ForCausalLM(config, torch.float32)
    tensors = list(model.parameters()) + list(model.buffers())
    assert estimate_num_parameters(config) == sum(t.numel() for t in tensors)
    # The GPU presets are the sizes their names promise.
    assert 2e8 < estimate_num_parameters(get_preset("dsv4-mini")) < 6e8
    assert 2e9 < estimate_num_parameters(get_preset("dsv4-flash-slice")) < 5e9


def test_to_dict_round_trips_hf_names(dsv4_reference_dir):
    raw = json.loads((dsv4_reference_dir / "DeepSeek-V4-Pro.config.json").read_text())
    c = DeepseekV4Config.from_dict(raw)
    d = c.to_dict()
    # Every field, unknown ones included, under its Hugging Face name, plus this runtime's own
    # shared-expert clamp flag (not a field of the release config).
    assert d == raw | {"shared_expert_swiglu_limit": True}
    assert "extra" not in d
    assert DeepseekV4Config.from_dict(d) == c


def test_unknown_fields_are_kept_in_extra():
    d = get_preset("dsv4-tiny").to_dict() | {"some_future_field": [1, 2], "use_cache": False}
    c = DeepseekV4Config.from_dict(d)
    assert c.extra == {"some_future_field": [1, 2], "use_cache": False}
    assert c.to_dict()["some_future_field"] == [1, 2]


def test_missing_optional_fields_take_defaults():
    d = get_preset("dsv4-tiny").to_dict()
    for key in ("hc_mult", "hc_eps", "scoring_func", "swiglu_limit", "num_hash_layers", "rope_scaling"):
        del d[key]
    c = DeepseekV4Config.from_dict(d)
    assert (c.hc_mult, c.hc_eps, c.scoring_func, c.swiglu_limit, c.num_hash_layers) == (4, 1e-6, "sqrtsoftplus", 0.0, 0)
    assert (c.rope_factor, c.original_max_position_embeddings) == (1.0, 0)
    assert c.fp8_weight_block_size is None


def test_unknown_model_path_lists_presets():
    with pytest.raises(ValueError) as e:
        load_model_config("no-such-model")
    for name in ("dsv4-tiny", "dsv4-mini", "dsv4-flash-slice"):
        assert name in str(e.value)


def test_config_is_frozen():
    c = get_preset("dsv4-tiny")
    with pytest.raises(AttributeError):
        c.hidden_size = 128


# (field the message must start with, changes applied to dsv4-tiny)
INVALID = [
    ("hidden_size", {"hidden_size": None}),
    ("hidden_size", {"hidden_size": 0}),
    ("hidden_size", {"hidden_size": "64"}),
    ("num_hidden_layers", {"num_hidden_layers": 4.0}),
    ("num_attention_heads", {"num_attention_heads": True}),
    ("num_key_value_heads", {"num_key_value_heads": 2}),
    ("head_dim", {"head_dim": 16}),
    ("qk_rope_head_dim", {"qk_rope_head_dim": 15}),
    ("qk_rope_head_dim", {"qk_rope_head_dim": 0}),
    ("o_groups", {"o_groups": 3}),
    ("num_experts_per_tok", {"num_experts_per_tok": 9}),
    ("num_hash_layers", {"num_hash_layers": 5}),
    ("compress_ratios", {"compress_ratios": [0, 4, 128]}),
    ("compress_ratios", {"compress_ratios": [0, 4, 64, 4]}),
    ("compress_ratios", {"compress_ratios": "0,4,128,4"}),
    ("scoring_func", {"scoring_func": "relu"}),
    ("rope_scaling", {"rope_scaling": {"type": "linear", "factor": 2.0}}),
    ("rope_scaling", {"rope_scaling": {"type": "yarn", "factor": 4.0}}),
    ("rope_scaling", {"rope_scaling": "yarn"}),
    ("sliding_window", {"sliding_window": 0}),
    ("index_topk", {"index_topk": 0}),
    ("index_head_dim", {"index_head_dim": 16}),
    ("hc_mult", {"hc_mult": 0}),
    ("rms_norm_eps", {"rms_norm_eps": 0.0}),
    ("rms_norm_eps", {"rms_norm_eps": "1e-6"}),
    ("routed_scaling_factor", {"routed_scaling_factor": -1.0}),
    ("vocab_size", {"eos_token_id": [1, 512]}),
    ("vocab_size", {"bos_token_id": 600}),
    ("eos_token_id", {"eos_token_id": "</s>"}),
    ("norm_topk_prob", {"norm_topk_prob": "yes"}),
    ("norm_topk_prob", {"norm_topk_prob": False}),  # parsed but not implemented: refused
    ("topk_method", {"topk_method": "greedy"}),
    ("quantization_config", {"quantization_config": ["fp8"]}),
]


@pytest.mark.parametrize("field,changes", INVALID, ids=[f"{f}-{i}" for i, (f, _) in enumerate(INVALID)])
def test_invalid_config_names_the_field(field, changes):
    d = get_preset("dsv4-tiny").to_dict() | changes
    with pytest.raises(ConfigError) as e:
        DeepseekV4Config.from_dict(d)
    assert str(e.value).startswith(f"{field}:"), str(e.value)


@pytest.mark.parametrize("field", ["vocab_size", "hidden_size", "head_dim", "compress_ratios", "index_topk"])
def test_missing_required_field_names_it(field):
    d = get_preset("dsv4-tiny").to_dict()
    del d[field]
    with pytest.raises(ConfigError, match=f"^{field}: required field is missing"):
        DeepseekV4Config.from_dict(d)


def test_o_groups_message():
    d = get_preset("dsv4-tiny").to_dict() | {"num_attention_heads": 6, "o_groups": 4}
    with pytest.raises(ConfigError) as e:
        DeepseekV4Config.from_dict(d)
    assert str(e.value) == "o_groups: num_attention_heads (6) must be divisible by o_groups (4)"


def test_index_topk_unused_without_c4_layers():
    d = get_preset("dsv4-tiny").to_dict() | {"compress_ratios": [0, 128, 0, 128], "index_topk": 0}
    assert DeepseekV4Config.from_dict(d).index_topk == 0


# ---- dsv4-flash: the real model's configuration --------------------------------------------


def test_flash_preset_has_the_release_dims():
    c = get_preset("dsv4-flash")
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.head_dim) == (4096, 43, 64, 512)
    assert (c.q_lora_rank, c.o_groups, c.o_lora_rank, c.qk_rope_head_dim) == (1024, 8, 1024, 64)
    assert (c.n_routed_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.n_shared_experts) == (256, 6, 2048, 1)
    assert (c.index_n_heads, c.index_head_dim, c.index_topk, c.sliding_window) == (64, 128, 512, 128)
    assert c.compress_ratios[:43] == [0, 0] + [4, 128] * 20 + [4]
    assert c.num_nextn_predict_layers == 1 and c.layer_compress_ratio(43) == 0  # the MTP entry, last
    assert (c.vocab_size, c.max_position_embeddings) == (129280, 1048576)
    assert c.fp8_weight_block_size == (128, 128) and c.expert_dtype == "fp4"
    assert c.quantization_config["scale_fmt"] == "ue8m0" and c.quantization_config["fmt"] == "e4m3"
    # About 284 B parameters (the release's figure), MTP layer excluded.
    assert 283e9 < estimate_num_parameters(c) < 286e9


def test_flash_preset_follows_the_pro_config_conventions(dsv4_reference_dir):
    raw_pro = json.loads((dsv4_reference_dir / "DeepSeek-V4-Pro.config.json").read_text())
    flash = get_preset("dsv4-flash").to_dict()
    # Same field set as the release config (plus this runtime's shared-expert clamp flag).
    assert set(flash) | {"transformers_version"} == set(raw_pro) | {"shared_expert_swiglu_limit"}
    differs = {k for k in raw_pro if k in flash and flash[k] != raw_pro[k]}
    assert differs == {
        "hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank", "o_groups",
        "n_routed_experts", "moe_intermediate_size", "index_topk", "compress_ratios",
    }
    # Pro's list is its layers plus one MTP entry; Flash's is built the same way.
    assert len(flash["compress_ratios"]) == flash["num_hidden_layers"] + flash["num_nextn_predict_layers"]
    assert len(raw_pro["compress_ratios"]) == raw_pro["num_hidden_layers"] + raw_pro["num_nextn_predict_layers"]


def test_flash_config_json_is_written_and_loads_back(tmp_path):
    from sglang.srt.configs.presets import main

    assert main(["dsv4-flash", "--write-config", str(tmp_path / "flash")]) == 0
    c = load_model_config(str(tmp_path / "flash"))
    assert c == get_preset("dsv4-flash")
    assert json.loads((tmp_path / "flash" / "config.json").read_text())["quantization_config"]["quant_method"] == "fp8"


def test_num_layers_keeps_the_dims_the_pattern_and_the_mtp_entry():
    from sglang.srt.configs.deepseek_v4 import with_num_layers

    full = get_preset("dsv4-flash")
    c = load_model_config("dsv4-flash", num_layers=20)
    assert c.num_hidden_layers == 20 and c.compress_ratios == full.compress_ratios[:20] + [0]
    assert c.layer_compress_ratio(20) == 0 and c.num_hash_layers == 3
    assert (c.hidden_size, c.n_routed_experts, c.index_topk) == (4096, 256, 512)
    assert 130e9 < estimate_num_parameters(c) < 136e9
    assert with_num_layers(full, 2).num_hash_layers == 2  # never more hash layers than layers
    assert with_num_layers(full, 43) is full
    assert load_model_config("dsv4-tiny", num_layers=3).compress_ratios == [0, 4, 128]
    for bad in (0, 44, 2.5):
        with pytest.raises(ConfigError, match="--num-layers"):
            with_num_layers(full, bad)


def test_a_run_builds_only_the_mtp_modules_speculation_runs():
    """ServerArgs.run_config: none without speculation, min(modules, k) with it; the compress
    ratios of the dropped modules go with them."""
    import dataclasses

    from sglang.srt.configs.deepseek_v4 import with_mtp_modules
    from sglang.srt.server_args import ServerArgs

    flash = get_preset("dsv4-flash")
    two = dataclasses.replace(flash, num_nextn_predict_layers=2, compress_ratios=flash.compress_ratios + [4])
    assert two.num_mtp_layers == 2
    mtp = dict(speculative_algorithm="mtp")
    for kw, modules in (({}, 0), (dict(mtp, speculative_num_steps=1), 1), (dict(mtp, speculative_num_steps=3), 2),
                        (mtp, 2)):  # the default k is 3
        c = ServerArgs(model_path="dsv4-flash", **kw).run_config(two)
        assert c.num_mtp_layers == modules and c.compress_ratios == two.compress_ratios[:43 + modules], kw
    assert with_mtp_modules(two, 2) is two and with_mtp_modules(flash, 0).compress_ratios == flash.compress_ratios[:43]
    for bad in (-1, 3, 1.5):
        with pytest.raises(ConfigError, match="MTP modules to keep"):
            with_mtp_modules(two, bad)


def test_num_layers_server_arg_reaches_the_model_config(tmp_path):
    from sglang.srt.configs.presets import write_config
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.server_args_cli import prepare_server_args

    args = prepare_server_args(["--model-path", "dsv4-tiny", "--num-layers", "2"])
    assert args.num_layers == 2
    r = args.resolve(cuda_available=False)
    assert r.num_layers == 2 and r.load_format == "dummy"
    with pytest.raises(ValueError, match="--num-layers must be positive"):
        ServerArgs(num_layers=0)
    with pytest.raises(ValueError, match="--num-layers needs --load-format dummy"):
        ServerArgs(model_path=write_config(get_preset("dsv4-tiny"), str(tmp_path)).rsplit("/", 1)[0],
                   num_layers=2).resolve(False)  # a checkpoint directory: auto is safetensors


def test_model_runner_builds_only_the_first_layers():
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.test.runner_args import cpu_server_args

    runner = ModelRunner(cpu_server_args(model_path="dsv4-tiny", num_layers=2, max_total_tokens=1024, max_running_requests=2))
    assert len(runner.model.layers) == 2 and runner.config.compress_ratios == [0, 4]
    assert len(runner.kv_pool.raw) == 2 and sorted(runner.kv_pool.compressed) == [1]


def test_flash_builds_in_the_release_format_at_its_expert_shard():
    """dsv4-flash (--num-layers 2) as the runner builds it for --load-format dummy at DP rank 1
    of 2: FP8 linears, FP4 experts allocated at the shard size from the start, the MTP layer's
    too; the server resolves it to dummy weights and release numerics. Meta device: shapes only."""
    import torch

    from sglang.srt.layers.moe.experts import Fp4RoutedExperts
    from sglang.srt.layers.quantization.fp8_linear import Fp8BlockLinear
    from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM
    from sglang.srt.server_args import ServerArgs

    r = ServerArgs(model_path="dsv4-flash", num_layers=2).resolve(cuda_available=False)
    assert (r.load_format, r.quant_numerics) == ("dummy", "release")
    config = load_model_config("dsv4-flash", num_layers=2)
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(config, torch.bfloat16, max_positions=256, expert_range=(128, 256))
    layers = list(model.layers) + list(model.mtp)
    assert len(layers) == 3  # two decoder layers + the MTP layer
    for layer in layers:
        experts = layer.ffn.experts
        assert isinstance(experts, Fp4RoutedExperts) and experts.first_expert == 128
        assert tuple(experts.w1.shape) == (128, 2048, 2048) and experts.w1.dtype == torch.int8  # 4096 / 2 bytes
        assert tuple(experts.w2_scale.shape) == (128, 4096, 2048 // 32)
        assert isinstance(layer.attn.wq_b, Fp8BlockLinear) and layer.attn.wq_b.weight.dtype == torch.float8_e4m3fn
