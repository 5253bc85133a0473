"""Checkpoint writer and loader: a synthetic DSV4 checkpoint (real key names and dtypes) loads
through the normal model-path code with identical logits; FP8 block-scaled weights dequantise
exactly where representable; broken checkpoints fail with an error naming the tensor."""

import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dsv4_harness import prefill_in_chunks  # noqa: E402

from sglang.srt.configs.loader import load_model_config  # noqa: E402
from sglang.srt.model_executor.model_runner import ModelRunner  # noqa: E402
from sglang.srt.model_loader.random_init import init_random_weights  # noqa: E402
from sglang.srt.model_loader.safetensors_io import save_checkpoint  # noqa: E402
from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM  # noqa: E402
from sglang.test.runner_args import cpu_server_args  # noqa: E402

FP8 = torch.float8_e4m3fn


def _runner(model_path, seed=0):
    return ModelRunner(cpu_server_args(model_path=str(model_path), random_seed=seed, dtype="float32",
                                       device="cpu", context_length=512, max_total_tokens=1024, max_running_requests=4))


TOKENS = torch.randint(2, 512, (140,), generator=torch.Generator().manual_seed(21)).tolist()


def _logits(runner):
    """Last-token logits after each of three chunks (crosses a c128 block end)."""
    return torch.stack(prefill_in_chunks(runner, TOKENS, [60, 70, 10]))


def _params(model):
    out = dict(model.named_parameters())
    out.update(model.named_buffers())
    return out


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A randomly initialised dsv4-tiny runner and its checkpoint directory."""
    src = _runner("dsv4-tiny", seed=3)
    ckpt = tmp_path_factory.mktemp("dsv4_ckpt")
    save_checkpoint(src.model, src.config, str(ckpt))
    return src, ckpt


def _copy_with(ckpt: Path, out: Path, edit) -> Path:
    """A copy of checkpoint `ckpt` in `out` with its tensor dict passed through `edit`."""
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(ckpt / "config.json", out / "config.json")
    tensors = load_file(str(ckpt / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(out / "model.safetensors"))
    return out


def test_writer_uses_the_release_key_names_dtypes_and_shapes(dsv4_reference_dir, tmp_path):
    ref_dir = dsv4_reference_dir / "conformance-tiny"
    config = load_model_config(str(ref_dir))
    model = DeepseekV4ForCausalLM(config, torch.float32)
    init_random_weights(model, seed=1)
    save_checkpoint(model, config, str(tmp_path))
    with safe_open(str(ref_dir / "model.safetensors"), framework="pt") as f:
        ref = {k: f.get_slice(k) for k in f.keys()}  # MTP layers included: the model has them too
        ref = {k: (tuple(s.get_shape()), s.get_dtype()) for k, s in ref.items()}
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        got = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
    assert sorted(got) == sorted(ref)
    mismatched = {k: (got[k], ref[k]) for k in ref if got[k] != ref[k]}
    assert not mismatched
    assert json.loads((tmp_path / "config.json").read_text())["compress_ratios"] == config.compress_ratios


def test_round_trip_gives_identical_weights_and_logits(source, tmp_path):
    src, ckpt = source
    loaded = _runner(ckpt)
    src_params, got_params = _params(src.model), _params(loaded.model)
    assert sorted(src_params) == sorted(got_params)
    # Every tensor comes back exactly, or exactly rounded to bf16 (the checkpoint's dtype for it).
    rounded = []
    for name, p in src_params.items():
        q = got_params[name]
        if torch.equal(q, p):
            continue
        assert torch.equal(q, p.to(torch.bfloat16).to(p.dtype)), name
        rounded.append(name)
    assert "layers.1.attn.wq_a.weight" in rounded and "embed.weight" in rounded
    assert not any("norm" in n or "hc_" in n or n.endswith(("ape", "attn_sink")) for n in rounded)
    assert "head.weight" not in rounded and "layers.2.attn.compressor.wkv.weight" not in rounded

    # The source model with its weights rounded the same way computes the same logits, bit for bit.
    reference = _runner("dsv4-tiny", seed=3)
    ref_params = _params(reference.model)
    with torch.no_grad():
        for name in rounded:
            ref_params[name].copy_(ref_params[name].to(torch.bfloat16).float())
    expect, got = _logits(reference), _logits(loaded)
    assert torch.equal(got, expect)
    assert not torch.equal(_logits(src), got)  # the rounding is real: the test can tell

    # Written again and reloaded: the same tensors and logits (the round trip is a fixed point).
    save_checkpoint(loaded.model, loaded.config, str(tmp_path / "again"))
    again = _runner(tmp_path / "again")
    for name, p in _params(again.model).items():
        assert torch.equal(p, got_params[name]), name
    assert torch.equal(_logits(again), got)


def test_missing_tensor_is_named(source, tmp_path):
    _, ckpt = source
    for key in ("layers.2.attn.compressor.ape", "layers.1.ffn.experts.5.w2.weight"):
        bad = _copy_with(ckpt, tmp_path / key, lambda t, k=key: t.pop(k))
        with pytest.raises(ValueError, match=re.escape(key)):
            _runner(bad)


def test_wrong_shape_is_named(source, tmp_path):
    _, ckpt = source
    key = "layers.3.attn.wq_a.weight"

    def edit(t):
        t[key] = torch.zeros(t[key].shape[0] + 1, t[key].shape[1], dtype=t[key].dtype)

    with pytest.raises(ValueError, match=re.escape(key)):
        _runner(_copy_with(ckpt, tmp_path / "bad", edit))


def test_unexpected_tensor_is_named(source, tmp_path):
    _, ckpt = source
    key = "layers.1.attn.bogus_proj.weight"

    def edit(t):
        t[key] = torch.zeros(4, 4, dtype=torch.bfloat16)

    with pytest.raises(ValueError, match=re.escape(key)):
        _runner(_copy_with(ckpt, tmp_path / "bad", edit))


@pytest.mark.parametrize("kind", ["fp4_expert", "fp8_linear"])
def test_release_format_tensor_in_a_bf16_config_is_refused_by_name(source, tmp_path, kind):
    """Quantized tensors need the release's config (quantization_config, expert_dtype fp4):
    without it they are refused by name, never dequantized or reinterpreted."""
    _, ckpt = source
    key = "layers.2.ffn.experts.1.w1.weight" if kind == "fp4_expert" else "layers.2.attn.wq_a.weight"

    def edit(t):
        rows, cols = t[key].shape
        if kind == "fp4_expert":
            t[key] = torch.zeros(rows, cols // 2, dtype=torch.int8)  # two FP4 values per byte
        else:
            t[key] = t[key].float().to(FP8)
        t[key[: -len(".weight")] + ".scale"] = torch.ones(rows, max(1, cols // 32))

    with pytest.raises(ValueError, match=re.escape(key[: -len(".weight")]) + r"\.(weight|scale).*quantization_config"):
        _runner(_copy_with(ckpt, tmp_path / "bad", edit))


def test_mtp_tensors_are_skipped(source, tmp_path):
    src, ckpt = source

    def edit(t):
        t["mtp.0.attn.wq_a.weight"] = torch.ones(32, 64, dtype=torch.bfloat16)
        t["mtp.0.e_proj.weight"] = torch.ones(64, 64, dtype=torch.bfloat16)
        t["mtp.0.hc_head_fn"] = torch.ones(4, 256)

    with_mtp = _runner(_copy_with(ckpt, tmp_path / "mtp", edit))
    plain = _runner(ckpt)
    assert torch.equal(_logits(with_mtp), _logits(plain))


def test_mtp_layers_of_a_real_checkpoint_load_exactly_and_are_built_only_when_speculating(dsv4_reference_dir, caplog):
    from sglang.srt.model_executor.forward_batch_info import ForwardMode, build_forward_batch
    from sglang.srt.model_loader.key_mapping import checkpoint_to_param
    from sglang.srt.planning.memory_planner import weight_bytes

    ckpt = dsv4_reference_dir / "conformance-tiny"
    args = dict(model_path=str(ckpt), context_length=512, max_total_tokens=1024)
    runner = ModelRunner(cpu_server_args(**args, speculative_algorithm="mtp", speculative_num_steps=2))
    model = runner.model
    assert len(model.mtp) == 1  # num_nextn_predict_layers, with its compress_ratios entry
    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        mtp_keys = [k for k in f.keys() if k.startswith("mtp.")]
        assert len(mtp_keys) > 40
        for key in mtp_keys:
            name, expert = checkpoint_to_param(key)
            dst = params[name] if expert is None else params[name][expert]
            assert torch.equal(dst, f.get_tensor(key).to(dst.dtype)), key
    assert len(runner.kv_pool.raw) == 5 and model.streams_out is not None

    # without speculation the MTP module is neither built nor loaded: no weights, caches or plan
    with caplog.at_level("INFO", logger="sglang.srt.model_loader.safetensors_io"):
        plain = ModelRunner(cpu_server_args(**args))
    assert len(plain.model.mtp) == 0 and plain.num_mtp_layers == 0
    assert f"skipped {len(mtp_keys)} tensors of MTP modules this run does not use" in caplog.text
    assert len(plain.kv_pool.raw) == 4 and plain.model.streams_out is None
    held = lambda m: sum(t.nbytes for t in list(m.parameters()) + list(m.buffers()))  # noqa: E731
    mtp_bytes = held(model.mtp)
    assert mtp_bytes > 0 and held(plain.model) == held(model) - mtp_bytes
    planned = lambda r: weight_bytes(r.config, "float32", "float32").total  # noqa: E731
    assert planned(runner) - planned(plain) == mtp_bytes
    fb = build_forward_batch(ForwardMode.EXTEND, [0], [0], [[5]], "cpu")
    with pytest.raises(ValueError, match="--speculative-algorithm mtp"):
        plain.forward_mtp(fb, torch.zeros(1, 4, 128))
    with pytest.raises(ValueError, match="MTP module 1: this runner runs modules 0..0"):
        runner.forward_mtp(fb, torch.zeros(1, 4, 128), k=1)
