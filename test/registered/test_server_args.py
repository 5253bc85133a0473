"""ServerArgs: defaults, the CLI, resolution of "auto" on CPU and on CUDA (passed in), errors."""

import dataclasses
import json

import pytest
import torch

from sglang.srt.configs.presets import get_preset
from sglang.srt.server_args import ServerArgs
from sglang.srt.server_args_cli import prepare_server_args

GiB = 2**30


def test_defaults_are_auto_until_resolved():
    a = ServerArgs()
    assert (a.model_path, a.page_size, a.port, a.host, a.random_seed) == ("dsv4-tiny", 128, 30000, "127.0.0.1", 0)
    assert (a.dtype, a.device, a.load_format, a.attention_backend) == ("auto", "auto", "auto", "auto")
    assert a.max_running_requests is None and a.max_total_tokens is None and a.chunked_prefill_size is None
    assert (a.dp_size, a.nnodes, a.node_rank, a.stream_interval, a.watchdog_timeout) == (1, 1, 0, 1, 300.0)
    assert (a.schedule_policy, a.load_balance_method, a.dp_idle_policy, a.log_level) == (
        "fcfs", "auto", "replay", "info")
    assert not a.resolved and not a.enable_mixed_chunk and not a.enable_breakable_cuda_graph


def test_resolve_on_cpu():
    a = ServerArgs()
    r = a.resolve(cuda_available=False)
    assert r.resolved and not a.resolved  # a new object; the original is untouched
    assert (r.device, r.dtype, r.load_format, r.attention_backend) == ("cpu", "float32", "dummy", "torch")
    assert r.segment_kernels == "off"  # auto follows the torch attention core
    assert r.context_length == 4096  # min(max_position_embeddings 4096, 4096)
    assert (r.max_running_requests, r.chunked_prefill_size) == (64, 256)
    assert (r.breakable_cuda_graph_max_tokens, r.cuda_graph_max_bs) == (512, 16)
    assert r.max_total_tokens == 65536  # min(4096 * 64, 65536)
    assert r.served_model_name == "dsv4-tiny"
    assert r.load_balance_method == "round_robin"  # auto without prefix caching under DP
    assert r.resolve(cuda_available=True) is r  # resolving twice changes nothing


def test_resolve_on_cuda_sizes_kv_from_free_memory():
    r = ServerArgs().resolve(cuda_available=True, gpu_free_memory=80 * GiB)
    assert (r.device, r.dtype) == ("cuda", "bfloat16")
    assert (r.max_running_requests, r.chunked_prefill_size) == (256, 2048)
    assert (r.breakable_cuda_graph_max_tokens, r.cuda_graph_max_bs) == (4096, 256)
    assert r.max_total_tokens == 4096 * 256  # capped by what the running requests could use
    # a context at which mini's KV (977 B a token: compressed entries and index keys) fills the GPU
    mini = ServerArgs(model_path="dsv4-mini", context_length=8192)
    # (at 2 GiB free, mini's graph pool + activation reserve just exceed the 20 % left over)
    small = mini.resolve(cuda_available=True, gpu_free_memory=3 * GiB)
    big = mini.resolve(cuda_available=True, gpu_free_memory=4 * GiB)
    assert 0 < small.max_total_tokens < big.max_total_tokens
    assert small.max_total_tokens % 128 == 0
    half = dataclasses.replace(mini, mem_fraction_static=0.5).resolve(cuda_available=True, gpu_free_memory=4 * GiB)
    assert half.max_total_tokens < big.max_total_tokens
    # Too small: the memory planner names the shortfall and the flag to change (0.742 GiB of
    # weights + 0.019 GiB of split compressor weights, tensor_core_copy_bytes).
    with pytest.raises(ValueError, match=r"weights need 0.8 GiB .* short by 0.3 GiB; raise --dp-size"):
        mini.resolve(cuda_available=True, gpu_free_memory=GiB // 2)
    # a KV size of the user's own skips the KV sizing, not the check that the weights fit
    sized = dataclasses.replace(mini, max_total_tokens=8192)
    with pytest.raises(ValueError, match=r"weights need 0.8 GiB .* short by 0.3 GiB; raise --dp-size"):
        sized.resolve(cuda_available=True, gpu_free_memory=GiB // 2)
    assert sized.resolve(cuda_available=True, gpu_free_memory=4 * GiB).max_total_tokens == 8192
    long_ctx = dataclasses.replace(mini, context_length=65536, max_running_requests=8, mem_fraction_static=0.4)
    with pytest.raises(ValueError, match=r"not enough memory for the KV cache: .* short by .* lower --context-length"):
        long_ctx.resolve(cuda_available=True, gpu_free_memory=2 * GiB)


def test_explicit_cpu_device_uses_cpu_defaults_even_with_cuda():
    r = ServerArgs(device="cpu").resolve(cuda_available=True)
    assert (r.device, r.dtype, r.max_running_requests, r.chunked_prefill_size) == ("cpu", "float32", 64, 256)


def test_explicit_values_survive_resolution():
    r = ServerArgs(dtype="bfloat16", context_length=1000, max_running_requests=8, max_total_tokens=1000,
                   chunked_prefill_size=-1, cuda_graph_max_bs=4, served_model_name="m").resolve(cuda_available=False)
    assert (r.dtype, r.context_length, r.max_running_requests, r.chunked_prefill_size) == ("bfloat16", 1000, 8, -1)
    assert r.max_total_tokens == 896  # whole pages
    assert r.cuda_graph_max_bs == 4 and r.served_model_name == "m" and not r.chunked_prefill_enabled


def test_checkpoint_directory_loads_safetensors_by_default(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(get_preset("dsv4-tiny").to_dict()))
    r = ServerArgs(model_path=str(tmp_path)).resolve(cuda_available=False)
    assert r.load_format == "safetensors"
    assert ServerArgs(model_path=str(tmp_path), load_format="dummy").resolve(cuda_available=False).load_format == "dummy"


def test_cli_round_trip():
    a = prepare_server_args([
        "--model-path", "dsv4-mini", "--port", "8080", "--enable-mixed-chunk", "--chunked-prefill-size", "-1",
        "--enable-breakable-cuda-graph", "--breakable-cuda-graph-tokens", "64", "128", "--dp-size", "2",
        "--enable-dp-attention", "--dp-idle-policy", "eager", "--mem-fraction-static", "0.7", "--dtype", "float32",
    ])
    assert (a.model_path, a.port, a.chunked_prefill_size, a.dp_size, a.dp_idle_policy) == ("dsv4-mini", 8080, -1, 2, "eager")
    assert a.enable_mixed_chunk and a.enable_breakable_cuda_graph and a.enable_dp_attention
    assert a.breakable_cuda_graph_tokens == (64, 128) and a.mem_fraction_static == 0.7 and a.dtype == "float32"
    assert prepare_server_args([]) == ServerArgs()
    with pytest.raises(SystemExit):
        prepare_server_args(["--dtype", "fp16"])


def test_decode_graph_sizes_of_the_user_s_own():
    a = prepare_server_args(["--model-path", "dsv4-tiny", "--cuda-graph-bs", "64", "1", "8", "1"])
    assert a.cuda_graph_bs == (64, 1, 8, 1)
    r = a.resolve(cuda_available=True, gpu_free_memory=80 * 2**30)
    assert r.cuda_graph_bs == (1, 8, 64) and r.cuda_graph_max_bs == 64  # sorted, once each; the largest caps
    # sizes no decode batch can reach (above the running requests) are left out, all of them: an error
    few = dataclasses.replace(a, max_running_requests=16).resolve(cuda_available=True, gpu_free_memory=80 * 2**30)
    assert few.cuda_graph_bs == (1, 8)
    with pytest.raises(ValueError, match=r"--cuda-graph-bs \[64\]: every size is above --max-running-requests 16"):
        ServerArgs(model_path="dsv4-tiny", cuda_graph_bs=[64], max_running_requests=16).resolve(cuda_available=False)
    assert ServerArgs(model_path="dsv4-tiny").resolve(cuda_available=False).cuda_graph_bs is None  # the ladder


def test_server_args_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ServerArgs().page_size = 256


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"page_size": 100}, "--page-size must be a multiple of 128"),
        ({"page_size": 0}, "--page-size must be a multiple of 128"),
        ({"max_running_requests": 0}, "--max-running-requests must be positive"),
        ({"max_total_tokens": -5}, "--max-total-tokens must be positive"),
        ({"max_total_tokens": 64}, "--max-total-tokens must be at least one page"),
        ({"context_length": -1}, "--context-length must be positive"),
        ({"chunked_prefill_size": 0}, "--chunked-prefill-size must be positive or -1"),
        ({"cuda_graph_max_bs": 0}, "--cuda-graph-max-bs must be positive"),
        ({"prefix_cache_state_gb": 0}, "--prefix-cache-state-gb must be positive"),
        ({"breakable_cuda_graph_tokens": [16, 0]}, "--breakable-cuda-graph-tokens must be positive"),
        ({"cuda_graph_bs": [4, 0]}, "--cuda-graph-bs must be positive integers"),
        ({"cuda_graph_bs": []}, "--cuda-graph-bs must be positive integers"),
        ({"cuda_graph_bs": [8, 64], "cuda_graph_max_bs": 32}, "--cuda-graph-bs has 64, above --cuda-graph-max-bs 32"),
        ({"dp_size": 0}, "--dp-size must be >= 1"),
        ({"dp_size": 2}, "--dp-size > 1 needs --enable-dp-attention"),
        ({"nnodes": 2, "node_rank": 2, "dist_init_addr": "h:1"}, "--node-rank must be in"),
        ({"nnodes": 2}, "--nnodes > 1 needs --dist-init-addr"),
        ({"dtype": "fp16"}, "--dtype must be one of auto, bfloat16, float32"),
        ({"load_balance_method": "random"}, "--load-balance-method must be one of"),
        ({"mem_fraction_static": 1.5}, "--mem-fraction-static must be in"),
        ({"stream_interval": 0}, "--stream-interval must be >= 1"),
        ({"port": 70000}, "--port must be in"),
    ],
)
def test_invalid_values_raise_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs(**kwargs)


@pytest.mark.parametrize(
    "kwargs, cuda, message",
    [
        ({"device": "cuda"}, False, "--device cuda was requested but CUDA is not available"),
        ({"context_length": 5000}, False, "exceeds the model's max_position_embeddings"),
        ({"load_format": "safetensors"}, False, "needs a checkpoint directory"),
        ({"breakable_cuda_graph_tokens": [1024]}, False, "above --breakable-cuda-graph-max-tokens 512"),
        ({"model_path": "no-such-model"}, False, "neither a preset"),
    ],
)
def test_resolution_errors(kwargs, cuda, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs(**kwargs).resolve(cuda_available=cuda)


def test_segment_kernels_flag():
    """--segment-kernels auto follows the attention kernels (on with Triton on CUDA); on CPU
    they are off unless forced on; anything but auto/on/off is refused."""
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.server_args import resolve_kernels
    from sglang.test.runner_args import cpu_server_args

    with pytest.raises(ValueError, match="--segment-kernels must be one of"):
        ServerArgs(segment_kernels="yes")
    assert prepare_server_args(["--segment-kernels", "off"]).segment_kernels == "off"
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_kernels("torch", "auto", cpu) == ("torch", False)
    assert resolve_kernels("torch", "on", cpu) == ("torch", True)
    assert resolve_kernels("triton", "auto", cuda) == ("triton", True)
    assert resolve_kernels("triton", "off", cuda) == ("triton", False)
    tiny = dict(max_total_tokens=1024, max_running_requests=2, context_length=256)
    assert not ModelRunner(cpu_server_args(**tiny)).attn_backend.segment_kernels
    assert ModelRunner(cpu_server_args(**tiny, segment_kernels="on")).attn_backend.segment_kernels


def test_release_format_flags():
    """--quant-numerics and --kv-cache-dtype: parsed, validated, resolved against the model
    (release numerics only for release-format weights); the model runner reads them from there."""
    a = ServerArgs()
    assert (a.quant_numerics, a.kv_cache_dtype) == ("release", None)  # None: resolved with the model
    a = prepare_server_args(["--quant-numerics", "weight_only", "--kv-cache-dtype", "fp8_e4m3",
                             "--model-path", "dsv4-tiny-fp8", "--load-format", "dummy"])
    assert (a.quant_numerics, a.kv_cache_dtype, a.model_path, a.load_format) == (
        "weight_only", "fp8_e4m3", "dsv4-tiny-fp8", "dummy")
    r = a.resolve(cuda_available=False)
    assert (r.quant_numerics, r.kv_cache_dtype, r.load_format) == ("weight_only", "fp8_e4m3", "dummy")
    assert ServerArgs(model_path="dsv4-tiny-fp8").resolve(cuda_available=False).quant_numerics == "release"
    assert ServerArgs(model_path="dsv4-tiny").resolve(cuda_available=False).quant_numerics == "weight_only"
    with pytest.raises(ValueError, match="--quant-numerics must be one of weight_only, release"):
        ServerArgs(quant_numerics="fp8")
    with pytest.raises(ValueError, match="--kv-cache-dtype must be one of auto, fp8_e4m3"):
        ServerArgs(kv_cache_dtype="fp8_e5m2")
    with pytest.raises(SystemExit):  # argparse refuses it too, with the choices
        prepare_server_args(["--kv-cache-dtype", "int8"])


def test_prefix_caching_flags_sglang_spelling_and_conflict():
    def resolved(argv):
        r = prepare_server_args(argv).resolve(cuda_available=False)
        return r.enable_prefix_caching, r.disable_radix_cache

    assert ServerArgs().enable_prefix_caching is None  # unset until resolve()
    assert resolved([]) == (True, False)  # on by default
    assert prepare_server_args(["--enable-prefix-caching"]).enable_prefix_caching is True
    assert resolved(["--enable-prefix-caching"]) == (True, False)
    off = prepare_server_args(["--disable-radix-cache"])
    assert (off.enable_prefix_caching, off.disable_radix_cache) == (None, True)
    assert resolved(["--disable-radix-cache"]) == (False, True)
    # the Python API may also say off directly; resolve() states it both ways
    r = ServerArgs(enable_prefix_caching=False).resolve(cuda_available=False)
    assert (r.enable_prefix_caching, r.disable_radix_cache) == (False, True)
    with pytest.raises(ValueError, match="contradict each other: --disable-radix-cache turns prefix caching off"):
        ServerArgs(enable_prefix_caching=True, disable_radix_cache=True)
    with pytest.raises(ValueError, match="contradict each other"):
        prepare_server_args(["--enable-prefix-caching", "--disable-radix-cache"])
    with pytest.raises(ValueError, match="--enable-prefix-caching must be true or false"):
        ServerArgs(enable_prefix_caching="yes")


@pytest.mark.parametrize("argv, kv_cache_dtype", [
    (["--model-path", "dsv4-tiny-fp8"], "fp8_e4m3"),  # release format, release numerics
    (["--model-path", "dsv4-flash-slice-fp8"], "fp8_e4m3"),
    (["--model-path", "dsv4-tiny"], "auto"),  # bf16: the model dtype
    (["--model-path", "dsv4-mini"], "auto"),
    (["--model-path", "dsv4-tiny-fp8", "--quant-numerics", "weight_only"], "auto"),  # nothing rounds the KV
    (["--model-path", "dsv4-tiny-fp8", "--kv-cache-dtype", "auto"], "auto"),  # an explicit choice wins
    (["--model-path", "dsv4-mini", "--kv-cache-dtype", "fp8_e4m3"], "fp8_e4m3"),
])
def test_kv_cache_dtype_default_resolves_with_the_model(argv, kv_cache_dtype):
    """Unset, --kv-cache-dtype resolves once at start-up: fp8_e4m3 where the release numerics run
    (their KV rounding keeps exactly what FP8 rows hold), the model dtype ("auto") otherwise."""
    a = prepare_server_args(argv)
    assert a.kv_cache_dtype == (kv_cache_dtype if "--kv-cache-dtype" in argv else None)
    r = a.resolve(cuda_available=False)
    assert r.kv_cache_dtype == kv_cache_dtype
    assert r.resolve(cuda_available=False) is r  # resolved once


def test_kv_cache_dtype_default_runs_the_runner_with_fp8_rows_and_packed_indexer_keys():
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.test.runner_args import cpu_server_args

    tiny = dict(model_path="dsv4-tiny-fp8", context_length=256, max_running_requests=2, max_total_tokens=512)
    pool = ModelRunner(cpu_server_args(**tiny)).kv_pool
    assert pool.kv_cache_dtype == "fp8_e4m3" and pool.raw[0].dtype == torch.uint8
    assert pool.index_key_layout is not None and pool.indexer_keys[1].shape == (512 // 4 + 32, 68)
    plain = ModelRunner(cpu_server_args(**tiny, quant_numerics="weight_only")).kv_pool
    assert plain.kv_cache_dtype == "auto" and plain.raw[0].dtype == torch.float32
    assert plain.index_key_layout is None and plain.indexer_keys[1].dtype == torch.float32


def test_kv_cache_dtype_help_states_the_default():
    from sglang.srt.server_args_cli import make_parser

    help_ = {a.dest: a.help for a in make_parser()._actions}["kv_cache_dtype"]
    assert "Default: fp8_e4m3 when the model runs the release numerics" in help_ and "else auto" in help_
