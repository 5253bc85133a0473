"""--moe-backend: its resolution, the backends behind Fp4RoutedExperts on CPU against the
reference formula, the runner attaching the resolved one, and humming's tuned-configuration
lookup (the parts that need no GPU)."""

import json

import pytest
import torch

from sglang.srt.layers.moe import backends
from sglang.srt.layers.moe.backends import make_fp4_backend, resolve_moe_backend
from sglang.srt.layers.moe.experts import Fp4RoutedExperts
from sglang.srt.server_args import MOE_BACKENDS, ServerArgs
from sglang.srt.server_args_cli import prepare_server_args

pytestmark = pytest.mark.usefixtures("single_intra_op_thread")


def test_flag_choices_are_auto_and_the_backend_names():
    assert MOE_BACKENDS == ("auto",) + backends.BACKEND_NAMES
    assert prepare_server_args(["--moe-backend", "humming"]).moe_backend == "humming"
    with pytest.raises(SystemExit):
        prepare_server_args(["--moe-backend", "cutlass"])
    with pytest.raises(ValueError, match="--moe-backend must be one of"):
        ServerArgs(moe_backend="cutlass")


def test_auto_resolves_by_device_segment_kernels_and_humming(monkeypatch):
    bf16 = torch.bfloat16
    assert resolve_moe_backend("auto", "cpu", torch.float32, False) == "torch"
    assert resolve_moe_backend("auto", "cpu", bf16, True) == "torch"  # humming and Triton are CUDA-only
    monkeypatch.setattr(backends, "humming_unsupported", lambda device, dtype: "not here")
    assert resolve_moe_backend("auto", "cuda", bf16, True) == "triton"
    assert resolve_moe_backend("auto", "cuda", bf16, False) == "torch"  # --segment-kernels off
    monkeypatch.setattr(backends, "humming_unsupported", lambda device, dtype: None)
    assert resolve_moe_backend("auto", "cuda", bf16, True) == "humming"
    assert resolve_moe_backend("auto", "cuda", bf16, False) == "torch"
    # bf16 experts have no backend choice: they follow the segment kernels
    assert resolve_moe_backend("auto", "cuda", bf16, True, fp4_experts=False) == "triton"


def test_explicit_choices_that_cannot_run_say_why(monkeypatch):
    with pytest.raises(ValueError, match="--moe-backend humming: humming runs on CUDA GPUs only|not installed"):
        resolve_moe_backend("humming", "cpu", torch.bfloat16, True)
    with pytest.raises(ValueError, match="triton needs a CUDA device"):
        resolve_moe_backend("triton", "cpu", torch.float32, True)
    with pytest.raises(ValueError, match="experts are bf16"):
        resolve_moe_backend("torch", "cpu", torch.float32, False, fp4_experts=False)
    monkeypatch.setattr(backends, "humming_import_error", lambda: None)
    with pytest.raises(ValueError, match="multiplies bf16 / fp16 activations; this model runs in torch.float32"):
        resolve_moe_backend("humming", "cuda", torch.float32, True)
    assert resolve_moe_backend("torch", "cuda", torch.bfloat16, True) == "torch"  # always possible


def test_humming_missing_is_reported_by_name(monkeypatch):
    backends.humming_import_error.cache_clear()
    monkeypatch.setattr(backends.importlib.util, "find_spec", lambda name: None)
    try:
        assert "humming-kernels is not installed" in backends.humming_import_error()
        with pytest.raises(ValueError, match="pip install 'sglang-dsv4\\[humming\\]'"):
            resolve_moe_backend("humming", "cuda", torch.bfloat16, True)
    finally:
        backends.humming_import_error.cache_clear()


def _fp4_experts(E, d, inter, act_quant, expert_range=None, seed=0):
    from dsv4_kernels.quant_reference import quantize_fp4

    g = torch.Generator().manual_seed(seed)
    e = Fp4RoutedExperts(E, d, inter, 6.0, act_quant, expert_range, torch.float32)
    n = e.w1.shape[0]
    for name, (rows, cols) in (("w1", (inter, d)), ("w3", (inter, d)), ("w2", (d, inter))):
        packed, scale = quantize_fp4(torch.randn(n, rows, cols, generator=g) * cols ** -0.5)
        getattr(e, name).copy_(packed.view(torch.int8))
        getattr(e, f"{name}_scale").copy_(scale.view(torch.uint8))
    return e


@pytest.mark.parametrize("act_quant", [True, False])
def test_cpu_backends_give_the_reference_sum_for_a_shard(act_quant):
    """torch and triton (the reference on CPU tensors) on experts [2, 6) of 8: other ranks'
    experts add nothing, a duplicated hash id counts once."""
    from dsv4_kernels.quant_reference import fp4_moe_ref

    experts = _fp4_experts(8, 256, 128, act_quant, expert_range=(2, 6))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 256, generator=g)
    ids = torch.tensor([[2, 5], [0, 7], [3, 3], [6, 4], [1, 2]])
    w = torch.rand(5, 2, generator=g) + 0.5
    local = torch.tensor([[0, 3], [-2, 5], [-1, 1], [4, 2], [-1, 0]])  # shard-local, duplicate -1
    want = fp4_moe_ref(x, experts.w1, experts.w1_scale, experts.w3, experts.w3_scale, experts.w2, experts.w2_scale,
                       local, w, 6.0, act_quant)
    assert experts.backend.name == "triton"  # until the runner attaches the resolved one
    got_triton = experts(x, w, ids)
    experts.use_backend(make_fp4_backend("torch"))
    assert experts.backend.name == "torch"
    got_torch = experts(x, w, ids)
    assert torch.equal(got_torch, want) and torch.equal(got_triton, want)
    assert want[1].abs().sum() == 0  # token 1's experts are all another rank's
    assert want.abs().sum() > 0


def test_backend_weight_bytes_count_what_the_experts_hold():
    experts = _fp4_experts(4, 64, 32, True)
    packed = 3 * 4 * (64 * 32 // 2 + 64 * 32 // 32)  # codes + e8m0 scales of w1, w3, w2
    assert experts.backend.weight_bytes(experts) == packed


def test_runner_attaches_the_resolved_backend_to_every_fp4_layer(dsv4_reference_dir):
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.test.runner_args import cpu_server_args

    runner = ModelRunner(cpu_server_args(model_path=str(dsv4_reference_dir / "conformance-tiny-fp8fp4"),
                                         context_length=256, max_total_tokens=1024, dtype="float32"))
    assert runner.server_args.moe_backend == "torch"  # CPU
    layers = [m for m in runner.model.layers.modules() if isinstance(m, Fp4RoutedExperts)]
    assert layers and all(m.backend.name == "torch" for m in layers)
    with pytest.raises(ValueError, match="--moe-backend humming"):
        cpu_server_args(model_path=str(dsv4_reference_dir / "conformance-tiny-fp8fp4"), context_length=256,
                        moe_backend="humming")


def test_a_bf16_model_takes_only_auto():
    from sglang.test.runner_args import cpu_server_args

    assert cpu_server_args(model_path="dsv4-tiny").moe_backend == "torch"
    with pytest.raises(ValueError, match="experts are bf16"):
        cpu_server_args(model_path="dsv4-tiny", moe_backend="triton")


def test_humming_tuned_lists_are_read_by_gpu_name(tmp_path, monkeypatch):
    from sglang.srt.layers.moe.backends import humming_moe

    monkeypatch.setattr(humming_moe.torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert humming_moe.device_key(0) == "nvidia_h200"
    key = humming_moe.gemm_key("w13", 4096, 4096, 128, 256, True)
    assert key == "w13,n=4096,k=4096,experts=128/256,act=fp8"
    monkeypatch.setattr(humming_moe, "CONFIG_DIR", tmp_path)
    assert humming_moe.load_tuned(0) == {}  # no file for this GPU: humming's heuristics
    lists = {key: [[0, 96, {"block_shape": [8, 256, 128]}], [96, 1 << 30, {"block_shape": [64, 128, 128]}]]}
    (tmp_path / "humming_nvidia_h200.json").write_text(json.dumps({"device": "NVIDIA H200", "configs": lists}))
    assert humming_moe.load_tuned(0) == lists
    gemm = humming_moe._Gemm(None, lists[key], json.dumps(lists[key]))
    assert [gemm.block_m(m) for m in (1, 96, 97, 100000)] == [8, 8, 64, 64]
    with pytest.raises(ValueError, match="no kernel configuration covers 0 rows"):
        gemm.block_m(0)


def test_the_shipped_h200_file_covers_every_row_count():
    from sglang.srt.layers.moe.backends import humming_moe

    data = json.loads((humming_moe.CONFIG_DIR / "humming_nvidia_h200.json").read_text())
    assert data["device"] == "NVIDIA H200"
    for key, ranges in data["configs"].items():
        assert ranges[0][0] == 0 and ranges[-1][1] >= 1 << 30, key
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), key  # contiguous, no gaps
        assert all("block_shape" in cfg for _, _, cfg in ranges), key


@pytest.mark.parametrize("shared_sums_rows,dp_moe", [(True, None), (False, None), (True, object())])
def test_moe_defers_the_routed_sum_only_to_a_shared_expert_that_sums_it(monkeypatch, shared_sums_rows, dp_moe):
    """DeepseekV4MoE asks its experts for their rows before the top-k sum (defer_sum) only
    when the shared expert takes them as its `add` (SharedExpert.takes_routed_rows) and no DP
    dispatcher sits between (its combine needs the sum); the output is the same either way."""
    from sglang.srt.configs.presets import get_preset
    from sglang.srt.layers.moe import experts as experts_mod
    from sglang.srt.model_executor.forward_context import forward_context

    cfg = get_preset("dsv4-tiny")
    layer = next(i for i in range(cfg.num_hidden_layers) if not cfg.is_hash_layer(i))
    torch.manual_seed(0)
    moe = experts_mod.DeepseekV4MoE(cfg, layer, torch.float32)
    for p in moe.parameters():
        p.copy_(torch.randn_like(p) * 0.1)
    x = torch.randn(1, cfg.hidden_size)
    ids = torch.zeros(1, dtype=torch.int64)
    with forward_context(None, None, 1):
        want = moe(x, ids)
    asked = []
    forward = type(moe.experts).forward
    monkeypatch.setattr(type(moe.experts), "forward",
                        lambda self, *a, defer_sum=False: asked.append(defer_sum) or forward(self, *a, defer_sum))
    monkeypatch.setattr(experts_mod.SharedExpert, "takes_routed_rows", lambda self: shared_sums_rows)
    monkeypatch.setattr(experts_mod, "dispatch_and_compute", lambda e, x, w, i, ctx: e(x, w, i))
    with forward_context(None, None, 1, dp_moe=dp_moe):
        got = moe(x, ids)
    assert asked == [shared_sums_rows and dp_moe is None]
    assert torch.equal(got, want)
