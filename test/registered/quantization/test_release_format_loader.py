"""The release weight format end to end on CPU: the writer and the streaming loader round-trip
a release-format checkpoint (single file and sharded), malformed checkpoints fail naming the
tensor, a DP rank reads only its experts, host RAM stays at about one tensor while loading,
and --load-format dummy builds realistic quantized weights."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from sglang.srt.configs.loader import load_model_config
from sglang.srt.configs.deepseek_v4 import ConfigError, DeepseekV4Config
from sglang.srt.configs.presets import release_format, dsv4_tiny_fp8_dims
from sglang.srt.layers.moe.experts import Fp4RoutedExperts
from sglang.srt.layers.quantization.fp8_linear import Fp8BlockLinear
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.model_loader.random_init import init_random_weights
from sglang.srt.model_loader.safetensors_io import CheckpointError, load_checkpoint, save_checkpoint
from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM
from sglang.test.runner_args import cpu_server_args

HERE = Path(__file__).resolve().parent
TOKENS = torch.randint(2, 512, (40,), generator=torch.Generator().manual_seed(4)).tolist()


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _runner(path, numerics="release", seed=0):
    return ModelRunner(cpu_server_args(model_path=str(path), random_seed=seed, dtype="float32", device="cpu",
                                       context_length=256, max_total_tokens=512, max_running_requests=2,
                                       quant_numerics=numerics))


def _logits(runner):
    sys.path.insert(0, str(HERE.parent / "models"))
    from dsv4_harness import prefill_in_chunks

    return torch.stack(prefill_in_chunks(runner, TOKENS, [25, 15]))


def _tensors(model):
    out = dict(model.named_parameters())
    out.update(model.named_buffers())
    return out


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """dsv4-tiny-fp8 with dummy weights (release format) and its checkpoint, written sharded."""
    src = _runner("dsv4-tiny-fp8", seed=5)
    ckpt = tmp_path_factory.mktemp("fp8_ckpt")
    save_checkpoint(src.model, src.config, str(ckpt))
    return src, ckpt


def test_dummy_preset_is_release_format_on_its_device(source):
    src, _ = source
    attn, experts = src.model.layers[1].attn, src.model.layers[1].ffn.experts
    assert isinstance(attn.wq_b, Fp8BlockLinear) and attn.wq_b.weight.dtype == torch.float8_e4m3fn
    assert attn.wq_b.act_quant  # release numerics by default
    assert isinstance(experts, Fp4RoutedExperts) and experts.w2.dtype == torch.int8
    # ue8m0 scales: every FP8 block scale is a power of two; FP4 scale bytes are e8m0 exponents.
    s = attn.wq_b.weight_scale
    assert torch.equal(s, torch.exp2(torch.log2(s).round()))
    assert experts.w1_scale.dtype == torch.uint8 and 100 < experts.w1_scale.float().mean() < 127
    assert not any(p.dtype == torch.bfloat16 for p in src.model.parameters())  # no bf16 master anywhere


def test_writer_writes_the_release_dtypes_and_config(source, dsv4_reference_dir):
    _, ckpt = source
    ref = dsv4_reference_dir / "conformance-tiny-fp8fp4" / "model.safetensors"
    with safe_open(str(ckpt / "model.safetensors"), "pt") as got, safe_open(str(ref), "pt") as want:
        for key in ("layers.1.attn.wq_b.weight", "layers.1.attn.wq_b.scale", "layers.1.ffn.experts.3.w2.weight",
                    "layers.1.ffn.experts.3.w2.scale", "layers.1.attn.wo_a.weight", "embed.weight", "head.weight"):
            g, w = got.get_slice(key), want.get_slice(key)
            assert (g.get_dtype(), g.get_shape()) == (w.get_dtype(), w.get_shape()), key
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["expert_dtype"] == "fp4" and cfg["quantization_config"]["scale_fmt"] == "ue8m0"


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (FP8 / packed FP4 / e8m0 bytes compared as bytes)."""
    if a.dtype != b.dtype:
        return False
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.element_size() == 1 else torch.equal(a, b)


def test_round_trip_is_exact(source, tmp_path):
    """Quantized tensors come back bit for bit; the rest as the checkpoint stores them (bf16
    weights, fp32 norms...), so a second save/load round trip changes nothing at all."""
    from sglang.srt.model_loader.key_mapping import param_to_checkpoint
    from sglang.srt.model_loader.safetensors_io import _ckpt_dtype

    src, ckpt = source
    loaded = _runner(ckpt)
    want, got = _tensors(src.model), _tensors(loaded.model)
    assert want.keys() == got.keys()
    for name, t in want.items():
        if t.element_size() == 1 or name.endswith("weight_scale"):
            assert _same(got[name], t), name
        else:
            assert torch.equal(got[name], t.to(_ckpt_dtype(param_to_checkpoint(name, 0))).to(t.dtype)), name
    save_checkpoint(loaded.model, loaded.config, str(tmp_path))
    again = _runner(tmp_path)
    assert all(_same(_tensors(again.model)[n], t) for n, t in got.items())
    assert torch.equal(_logits(again), _logits(loaded))


def test_sharded_checkpoint_with_index_loads(source, tmp_path):
    src, ckpt = source
    save_checkpoint(src.model, src.config, str(tmp_path), max_shard_bytes=1 << 20)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and not (tmp_path / "model.safetensors").exists()
    loaded = _runner(tmp_path)
    single = _runner(ckpt)
    assert all(_same(_tensors(loaded.model)[n], t) for n, t in _tensors(single.model).items())


def test_fp32_scales_are_accepted(source, tmp_path):
    """quantization_config without scale_fmt: F32 block scales (the older FP8 layout)."""
    src, ckpt = source
    out = _edit(ckpt, tmp_path / "f32", lambda t: [t.__setitem__(k, _e8m0_as_fp32(v)) for k, v in list(t.items())
                                                     if k.endswith(".scale")])
    cfg = json.loads((out / "config.json").read_text())
    del cfg["quantization_config"]["scale_fmt"]
    (out / "config.json").write_text(json.dumps(cfg))
    loaded = _runner(out)
    a, b = src.model.layers[2].attn.wq_a, loaded.model.layers[2].attn.wq_a
    assert torch.equal(a.weight_scale, b.weight_scale)
    assert torch.equal(src.model.layers[0].ffn.experts.w2_scale, loaded.model.layers[0].ffn.experts.w2_scale)


def _e8m0_as_fp32(t):
    from dsv4_kernels.quant_reference import e8m0_to_fp32

    return e8m0_to_fp32(t.view(torch.uint8))


def _edit(ckpt: Path, out: Path, edit) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(ckpt / "config.json", out / "config.json")
    tensors = load_file(str(ckpt / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize("case, key, message", [
    ("wrong_scale_shape", "layers.1.attn.wq_b.scale", r"expected the FP8 block scale F8_E8M0 or F32 \[4, 1\]"),
    ("fp4_odd_k", "layers.2.ffn.experts.4.w1.weight", r"expected an FP4 expert weight I8 \[128, 128\].*odd"),
    ("missing_fp8_scale", "layers.3.attn.wkv.scale", r"is missing: the quantized weight layers\.3\.attn\.wkv\.weight"),
    ("missing_fp4_scale", "layers.0.ffn.experts.6.w3.scale", r"is missing: the quantized weight "
                                                              r"layers\.0\.ffn\.experts\.6\.w3\.weight"),
    ("bf16_for_fp8", "layers.1.attn.wo_b.weight", r"expected an FP8 weight F8_E4M3 \[256, 128\], got BF16"),
])
def test_malformed_checkpoint_names_the_tensor(source, tmp_path, case, key, message):
    _, ckpt = source

    def edit(t):
        if case == "wrong_scale_shape":
            t[key] = t[key][:2]
        elif case == "fp4_odd_k":
            t[key] = t[key][:, :127].contiguous()
        elif case.startswith("missing"):
            del t[key]
        else:
            t[key] = t[key].to(torch.bfloat16)

    with pytest.raises(CheckpointError, match=re.escape(key) + ".*" + message if not case.startswith("missing")
                       else re.escape(key) + " " + message):
        _runner(_edit(ckpt, tmp_path / case, edit))


@pytest.mark.parametrize("patch, message", [
    ({"quant_method": "awq"}, "quant_method 'awq' is not supported"),
    ({"fmt": "e5m2"}, "fmt 'e5m2' is not supported"),
    ({"weight_block_size": [64, 64]}, r"weight_block_size must be \[128, 128\]"),
    ({"scale_fmt": "e4m3"}, "scale_fmt 'e4m3' is not supported"),
])
def test_unsupported_quantization_config_is_a_config_error(patch, message):
    d = release_format(dsv4_tiny_fp8_dims()).to_dict()
    d["quantization_config"].update(patch)
    with pytest.raises(ConfigError, match="quantization_config: " + message):
        DeepseekV4Config.from_dict(d)


def test_release_format_needs_whole_blocks_and_a_known_expert_dtype():
    d = load_model_config("dsv4-tiny").to_dict()  # hidden 64: not a whole 128 block
    with pytest.raises(ConfigError, match="hidden_size: must be a multiple of 128"):
        DeepseekV4Config.from_dict({**d, "expert_dtype": "fp4"})
    with pytest.raises(ConfigError, match="expert_dtype: must be one of"):
        DeepseekV4Config.from_dict({**d, "expert_dtype": "int4"})
    with pytest.raises(ConfigError, match="quantization_config: missing 'quant_method'"):
        DeepseekV4Config.from_dict({**d, "quantization_config": {"fmt": "e4m3"}})


def test_dp_rank_reads_only_its_experts(source):
    src, ckpt = source
    model = DeepseekV4ForCausalLM(src.config, torch.float32, max_positions=64, expert_range=(2, 6))
    read = []
    load_checkpoint(model, str(ckpt), on_tensor=lambda key, t: read.append(key))
    experts_read = {int(m[1]) for k in read if (m := re.search(r"\.experts\.(\d+)\.", k))}
    assert experts_read == {2, 3, 4, 5}
    assert model.layers[1].ffn.experts.w1.shape[0] == 4  # built at the shard size
    full = src.model.layers[1].ffn.experts
    assert torch.equal(model.layers[1].ffn.experts.w1, full.w1[2:6])
    assert torch.equal(model.layers[1].ffn.experts.w2_scale, full.w2_scale[2:6])


@pytest.mark.parametrize("preset, names", [("dsv4-tiny-fp8", ("w1", "w3_scale")), ("dsv4-tiny", ("w1", "w2"))])
def test_dummy_expert_shard_equals_the_slice_of_the_whole(preset, names):
    """A DP rank's model, built at its shard size, holds exactly its slice of the whole model's
    experts (what building whole and then keep_shard_ gave), and everything else identical."""
    config = load_model_config(preset)
    whole = DeepseekV4ForCausalLM(config, torch.float32, max_positions=64)
    part = DeepseekV4ForCausalLM(config, torch.float32, max_positions=64, expert_range=(4, 8))
    init_random_weights(whole, seed=2)
    init_random_weights(part, seed=2)
    for layer in (0, 3):
        for name in names:
            got, full = getattr(part.layers[layer].ffn.experts, name), getattr(whole.layers[layer].ffn.experts, name)
            assert got.shape[0] == 4 and torch.equal(got, full[4:])
    whole.layers[3].ffn.experts.keep_shard_(4, 8)
    assert all(torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                           b.view(torch.uint8) if b.element_size() == 1 else b)
               for a, b in zip(part.layers[3].parameters(), whole.layers[3].parameters()))


def test_dummy_weights_route_broadly_and_give_peaked_logits():
    runner = _runner("dsv4-tiny-fp8", seed=1)
    counts = torch.zeros(runner.config.n_routed_experts)
    def count(mod, args, out) -> None:
        counts.add_(torch.bincount(args[2].flatten(), minlength=counts.numel()))

    hooks = [layer.ffn.experts.register_forward_hook(count)  # the top-k routed layers
             for layer in runner.model.layers[runner.config.num_hash_layers:]]
    logits = _logits(runner)
    for h in hooks:
        h.remove()
    share = counts / counts.sum()
    print(f"dummy dsv4-tiny-fp8: expert load shares {[round(s, 3) for s in share.tolist()]}, "
          f"logit std per row {logits.std(-1).tolist()}")
    assert (share > 0).all() and share.max() < 3 / counts.numel()  # no expert starved or dominant
    assert (logits.std(-1) > 0.5).all() and torch.isfinite(logits).all()


def test_host_ram_peak_is_about_one_tensor(tmp_path):
    """A 200 MiB release-format checkpoint (~15x the bound, ~800x its largest tensor) loads
    while anonymous host memory grows by at most the largest tensor plus 8 MiB plus 1 KiB of
    bookkeeping per checkpoint key (key lists, the loaded-name set: ~1 KiB/key measured); the
    old whole-checkpoint read would grow by the whole checkpoint."""
    config = release_format(dsv4_tiny_fp8_dims())
    d = config.to_dict()
    d.update(n_routed_experts=64, moe_intermediate_size=1024, num_hidden_layers=8, compress_ratios=[0, 4, 128, 4] * 2)
    big = DeepseekV4Config.from_dict(d)
    model = DeepseekV4ForCausalLM(big, torch.float32, max_positions=64)
    save_checkpoint(model, big, str(tmp_path))
    total = os.path.getsize(tmp_path / "model.safetensors")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, str(HERE / "_peak_rss_load.py"), str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    bound = r["largest_tensor"] + (8 << 20) + 1024 * r["n_keys"]
    print(f"checkpoint {total >> 20} MiB, largest tensor {r['largest_tensor'] >> 10} KiB, "
          f"peak anonymous RSS growth {r['peak_growth'] / 2 ** 20:.1f} MiB (bound {bound / 2 ** 20:.1f} MiB)")
    assert total > 10 * bound
    assert r["peak_growth"] <= bound
