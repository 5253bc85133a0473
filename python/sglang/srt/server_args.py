"""Server arguments: one frozen dataclass, the CLI that fills it, and `resolve()`.

"auto" values (None for sizes) depend on the device and the model; `resolve()` makes them
concrete once, into a new object, so no component ever re-derives a default on its own.
Everything downstream (runner, scheduler, server) takes a resolved object.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import List, Optional, Tuple


DTYPES = ("auto", "bfloat16", "float32")
DEVICES = ("auto", "cuda", "cpu")
LOAD_FORMATS = ("auto", "dummy", "safetensors")  # auto: dummy for presets, safetensors for dirs
QUANT_NUMERICS = ("weight_only", "release")
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")  # auto: the model dtype; unset: default_kv_cache_dtype
ATTENTION_BACKENDS = ("auto", "torch", "triton")
SEGMENT_KERNELS = ("auto", "on", "off")
MOE_BACKENDS = ("auto", "torch", "triton", "humming")  # layers/moe/backends/
SPECULATIVE_ALGORITHMS = (None, "mtp")  # speculative/
SPECULATIVE_DEFAULT_STEPS = 3
SPECULATIVE_MAX_STEPS = 4
SCHEDULE_POLICIES = ("fcfs", "lpm")  # lpm: longest cached prefix first (managers/prefix_caching.py)
# auto: cache_aware with prefix caching (on unless --disable-radix-cache) and --dp-size > 1,
# else round_robin
LOAD_BALANCE_METHODS = ("auto", "round_robin", "least_loaded", "cache_aware")
DP_IDLE_POLICIES = ("replay", "eager")
MOE_DISPATCHERS = ("gather",)  # layers/moe/ep_dispatch.py
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
# Parsers of generated text (srt/parsers/), spelled as SGLang and vLLM spell them so their
# launch commands work unchanged; "none" returns the model's text as it is.
TOOL_CALL_PARSERS = ("deepseekv4", "deepseek_v4", "none")
REASONING_PARSERS = ("deepseek-v4", "deepseek_v4", "none")

# Device-dependent defaults: (cpu, cuda).
_DEFAULT_MAX_RUNNING_REQUESTS = (64, 256)
_DEFAULT_CHUNKED_PREFILL_SIZE = (256, 2048)
_DEFAULT_BREAKABLE_MAX_TOKENS = (512, 4096)
_DEFAULT_CUDA_GRAPH_MAX_BS = (16, 256)
_DEFAULT_MAX_CONTEXT_LENGTH = 4096
# CPU serving is for tests and demos and shares host memory with everything else.
_CPU_MAX_TOTAL_TOKENS = 65536


@dataclass(frozen=True)
class ServerArgs:
    # model and weights
    model_path: str = "dsv4-tiny"
    tokenizer_path: Optional[str] = None
    load_format: str = "auto"
    num_layers: Optional[int] = None  # keep only the model's first N layers (same dims)
    dtype: str = "auto"
    device: str = "auto"
    random_seed: int = 0
    quant_numerics: str = "release"
    kv_cache_dtype: Optional[str] = None  # None: default_kv_cache_dtype of the resolved numerics
    # HTTP
    host: str = "127.0.0.1"
    port: int = 30000
    served_model_name: Optional[str] = None
    max_request_bytes: int = 32 * 1024 * 1024
    shutdown_timeout: float = 20.0
    tool_call_parser: str = "deepseekv4"
    reasoning_parser: str = "deepseek-v4"
    # memory and scheduling (None = auto)
    context_length: Optional[int] = None
    page_size: int = 128
    max_running_requests: Optional[int] = None
    max_total_tokens: Optional[int] = None
    mem_fraction_static: float = 0.8
    chunked_prefill_size: Optional[int] = None
    enable_mixed_chunk: bool = False
    schedule_policy: str = "fcfs"
    disable_overlap_schedule: bool = False
    enable_prefix_caching: Optional[bool] = None  # None: on unless disable_radix_cache (resolve())
    disable_radix_cache: bool = False  # SGLang's spelling of prefix caching off
    prefix_cache_state_gb: float = 8.0  # host memory of the cached prefixes' resume states, per DP rank
    # kernels and graphs
    attention_backend: str = "auto"
    enable_breakable_cuda_graph: bool = False
    breakable_cuda_graph_max_tokens: Optional[int] = None
    breakable_cuda_graph_tokens: Optional[Tuple[int, ...]] = None
    cuda_graph_max_bs: Optional[int] = None
    cuda_graph_bs: Optional[Tuple[int, ...]] = None
    disable_cuda_graph: bool = False
    debug_cuda_graph: bool = False
    segment_kernels: str = "auto"
    moe_backend: str = "auto"
    # speculative decoding
    speculative_algorithm: Optional[str] = None
    speculative_num_steps: Optional[int] = None  # None: SPECULATIVE_DEFAULT_STEPS when speculating
    # data parallel attention and multi-node
    enable_dp_attention: bool = False
    dp_size: int = 1
    load_balance_method: str = "auto"
    load_balance_max_imbalance: int = 4
    dp_idle_policy: str = "replay"
    moe_dispatcher: str = "gather"
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: Optional[str] = None
    # operations
    log_level: str = "info"
    stream_interval: int = 1
    watchdog_timeout: float = 300.0
    # set by resolve(); not a CLI flag
    resolved: bool = False

    def __post_init__(self):
        for name in ("breakable_cuda_graph_tokens", "cuda_graph_bs"):  # lists from the CLI: keep them hashable
            if getattr(self, name) is not None:
                object.__setattr__(self, name, tuple(getattr(self, name)))
        _validate(self)

    # ---- resolution --------------------------------------------------------------------

    def resolve(self, cuda_available: bool, model_config=None, gpu_free_memory: Optional[int] = None) -> ServerArgs:
        """A new ServerArgs with every "auto" made concrete.

        cuda_available: whether a CUDA device can be used (passed in so tests resolve both
        ways on CPU). model_config: the DeepseekV4Config (loaded from model_path when None).
        gpu_free_memory: free bytes on the GPU, used for --max-total-tokens on CUDA and to check
        that the weights fit while they load (queried from torch when None; resolving for CUDA
        on a machine without one checks nothing unless it is given).
        """
        if self.resolved:
            return self
        if self.device == "cuda" and not cuda_available:
            raise ValueError("--device cuda was requested but CUDA is not available")
        device = self.device if self.device != "auto" else ("cuda" if cuda_available else "cpu")
        on_cuda = device == "cuda"
        # Triton kernels for the attention core on CUDA, the plain-torch reference elsewhere
        attention_backend, segment_kernels = resolve_kernels(self.attention_backend, self.segment_kernels, device)
        if model_config is None:
            from sglang.srt.configs.loader import load_model_config

            model_config = load_model_config(self.model_path, self.num_layers)
        elif self.num_layers is not None:
            from sglang.srt.configs.deepseek_v4 import with_num_layers

            model_config = with_num_layers(model_config, self.num_layers)
        if self.speculative_algorithm is not None and model_config.num_mtp_layers == 0:
            raise ValueError(f"--speculative-algorithm mtp drafts with the model's MTP layers, and {self.model_path!r} "
                             "has none (num_nextn_predict_layers 0, or no compress ratio listed for them)")
        model_config = self.run_config(model_config)  # the plan counts the MTP modules that run
        is_preset = not os.path.isdir(self.model_path)  # a preset name or a bare config.json
        load_format = self.load_format
        if load_format == "auto":
            load_format = "dummy" if is_preset else "safetensors"
        if load_format == "safetensors" and is_preset:
            raise ValueError(f"--load-format safetensors needs a checkpoint directory, got {self.model_path!r}")
        if self.num_layers is not None and load_format != "dummy":
            # a checkpoint holds every layer; the loader refuses tensors the model does not have
            raise ValueError("--num-layers needs --load-format dummy (random weights), not a checkpoint")

        max_pos = model_config.max_position_embeddings
        context_length = self.context_length or min(max_pos, _DEFAULT_MAX_CONTEXT_LENGTH)
        if context_length > max_pos:
            raise ValueError(
                f"--context-length {context_length} exceeds the model's max_position_embeddings ({max_pos})"
            )
        pick = 1 if on_cuda else 0
        max_running = self.max_running_requests or _DEFAULT_MAX_RUNNING_REQUESTS[pick]
        dtype = self.dtype if self.dtype != "auto" else ("bfloat16" if on_cuda else "float32")
        import torch

        from sglang.srt.layers.moe.backends import resolve_moe_backend
        from sglang.srt.layers.quantization import QuantMode

        # release numerics are the release format's: a bf16 model has nothing to round
        quant_numerics = QuantMode.resolve_numerics(model_config, self.quant_numerics)
        kv_cache_dtype = self.kv_cache_dtype or default_kv_cache_dtype(quant_numerics)
        moe_backend = resolve_moe_backend(self.moe_backend, device, getattr(torch, dtype), segment_kernels,
                                          fp4_experts=model_config.fp4_experts)
        max_total_tokens = self.max_total_tokens

        def plan(check_only: bool = False):
            free = gpu_free_memory if gpu_free_memory is not None else _query_gpu_free_memory()
            return self._memory_plan(model_config, dtype, quant_numerics, kv_cache_dtype, free, context_length,
                                     max_running, pick, moe_backend, check_only)

        if max_total_tokens is None:
            # never more than the running requests could ever use
            cap = context_length * max_running
            if on_cuda:
                max_total_tokens = plan().kv_pool_tokens
            else:
                max_total_tokens = min(cap, max(_CPU_MAX_TOTAL_TOKENS, context_length))
            if max_total_tokens < self.page_size:
                raise ValueError(
                    f"not enough memory for the KV cache: {max_total_tokens} tokens fit, less than one page "
                    f"({self.page_size}); use a smaller model or raise --mem-fraction-static"
                )
        elif on_cuda and (gpu_free_memory is not None or torch.cuda.is_available()):
            plan(check_only=True)  # a KV size of the user's own: the weights must still fit, loading included
        max_total_tokens = max_total_tokens // self.page_size * self.page_size  # whole pages
        breakable_max = self.breakable_cuda_graph_max_tokens or _DEFAULT_BREAKABLE_MAX_TOKENS[pick]
        if self.breakable_cuda_graph_tokens and max(self.breakable_cuda_graph_tokens) > breakable_max:
            raise ValueError(
                f"--breakable-cuda-graph-tokens has {max(self.breakable_cuda_graph_tokens)}, "
                f"above --breakable-cuda-graph-max-tokens {breakable_max}"
            )
        prefix_caching = resolve_prefix_caching(self)
        if self.schedule_policy == "lpm" and not prefix_caching:
            raise ValueError("--schedule-policy lpm admits the waiting requests with the longest cached prefix "
                             "first: it needs prefix caching (on by default; drop --disable-radix-cache)")
        return dataclasses.replace(
            self,
            enable_prefix_caching=prefix_caching,
            disable_radix_cache=not prefix_caching,
            load_balance_method=resolve_load_balance_method(self),
            device=device,
            dtype=dtype,
            load_format=load_format,
            quant_numerics=quant_numerics,
            kv_cache_dtype=kv_cache_dtype,
            tokenizer_path=self.tokenizer_path,
            served_model_name=self.served_model_name or self.model_path,
            context_length=context_length,
            max_running_requests=max_running,
            max_total_tokens=max_total_tokens,
            chunked_prefill_size=self.chunked_prefill_size or _DEFAULT_CHUNKED_PREFILL_SIZE[pick],
            attention_backend=attention_backend,
            segment_kernels="on" if segment_kernels else "off",
            moe_backend=moe_backend,
            speculative_num_steps=(self.speculative_num_steps or SPECULATIVE_DEFAULT_STEPS)
            if self.speculative_algorithm is not None else None,
            # the host needs each step's accepted tokens before it can build the next
            disable_overlap_schedule=self.disable_overlap_schedule or self.speculative_algorithm is not None,
            breakable_cuda_graph_max_tokens=breakable_max,
            cuda_graph_max_bs=self._decode_graph_max_bs(pick),
            cuda_graph_bs=_decode_graph_sizes(self.cuda_graph_bs, max_running),
            resolved=True,
        )

    def _decode_graph_max_bs(self, pick: int) -> int:
        """The largest decode-graph batch: as given, else the largest of --cuda-graph-bs, else the default."""
        return self.cuda_graph_max_bs or (max(self.cuda_graph_bs) if self.cuda_graph_bs
                                          else _DEFAULT_CUDA_GRAPH_MAX_BS[pick])

    def _memory_plan(self, model_config, dtype: str, quant_numerics: str, kv_cache_dtype: str, free: int,
                     context_length: int, max_running: int, pick: int, moe_backend: str, check_only: bool = False):
        """This GPU's memory plan (planning/memory_planner.py); raises MemoryPlanError, which
        names the shortfall and the flag to change, when the model or the KV cache does not fit.
        check_only: only whether the weights fit, loading included (their bytes are returned)."""
        from sglang.srt.planning.memory_planner import (
            PlanSettings,
            check_weights_fit,
            loaded_weight_format,
            plan_memory,
        )

        settings = PlanSettings(
            weight_format=loaded_weight_format(model_config, dtype), model_dtype=dtype,
            quant_numerics=quant_numerics, kv_cache_dtype=kv_cache_dtype,
            dp_size=self.dp_size if self.enable_dp_attention else 1, page_size=self.page_size,
            context_length=context_length, max_running_requests=max_running,
            # -1 (no chunking): a whole prompt of up to the context length per step
            chunked_prefill_size=(self.chunked_prefill_size or _DEFAULT_CHUNKED_PREFILL_SIZE[pick])
            if self.chunked_prefill_size != -1 else context_length,
            breakable_max_tokens=max(self.breakable_cuda_graph_tokens or (
                self.breakable_cuda_graph_max_tokens or _DEFAULT_BREAKABLE_MAX_TOKENS[pick],))
            if self.enable_breakable_cuda_graph else 0,
            decode_graph_max_bs=0 if self.disable_cuda_graph else min(self._decode_graph_max_bs(pick), max_running),
            mem_fraction_static=self.mem_fraction_static, max_total_tokens=None,  # sized by this plan
            mtp_layers=model_config.num_mtp_layers, moe_backend=moe_backend,
        )
        if check_only:
            return check_weights_fit(model_config, settings, free)
        return plan_memory(model_config, settings, free)

    @property
    def torch_dtype(self):
        import torch

        if self.dtype == "auto":
            raise ValueError("dtype is still 'auto': resolve() the ServerArgs first")
        return {"bfloat16": torch.bfloat16, "float32": torch.float32}[self.dtype]

    def run_config(self, model_config):
        """The model as this run builds it: with speculative decoding, the first
        min(modules, --speculative-num-steps) MTP modules (draft step s runs module
        min(s, modules - 1)); without it, none."""
        from sglang.srt.configs.deepseek_v4 import with_mtp_modules

        if self.speculative_algorithm is None:
            return with_mtp_modules(model_config, 0)
        steps = self.speculative_num_steps or SPECULATIVE_DEFAULT_STEPS
        return with_mtp_modules(model_config, min(model_config.num_mtp_layers, steps))

    @property
    def max_step_tokens(self) -> int:
        """The most tokens one forward step carries (planning/step_tokens.py): the raw-KV
        staging rows, and the scheduler's bound on a step."""
        from sglang.srt.planning.step_tokens import max_step_tokens

        if not self.resolved:
            raise ValueError("max_step_tokens needs resolved ServerArgs: call resolve() first")
        bucket = 0  # the largest breakable-graph bucket, as the runner builds its buckets
        if self.enable_breakable_cuda_graph:
            bucket = max(self.breakable_cuda_graph_tokens or (self.breakable_cuda_graph_max_tokens,))
        return max_step_tokens(
            chunked_prefill_size=self.chunked_prefill_size, context_length=self.context_length,
            max_running_requests=self.max_running_requests, breakable_max_tokens=bucket)

    @property
    def chunked_prefill_enabled(self) -> bool:
        return self.chunked_prefill_size is not None and self.chunked_prefill_size > 0


def default_kv_cache_dtype(quant_numerics: str) -> str:
    """--kv-cache-dtype when it is not given, from the resolved --quant-numerics: fp8_e4m3 for a
    model that runs the release numerics (its KV nope dims are FP8-rounded per 64 anyway, so an
    FP8 cache holds exactly those values, in 584 instead of 1024 bytes per bf16 entry at
    head_dim 512), else auto (the model dtype: a bf16 model's KV stays exact)."""
    return "fp8_e4m3" if quant_numerics == "release" else "auto"


def resolve_kernels(attention_backend: str, segment_kernels: str, device) -> Tuple[str, bool]:
    """The one place torch-or-Triton is chosen: (attention core "torch" | "triton", whether
    the in-segment pieces call dsv4_kernels ops). Attention 'auto' -> Triton on CUDA when
    triton imports, the plain-torch reference otherwise; segment kernels 'auto' follow it."""
    on_cuda = str(device).split(":")[0] == "cuda"  # a torch.device or its name
    if attention_backend == "auto":
        from dsv4_kernels.ops import triton_available

        attention_backend = "triton" if on_cuda and triton_available() else "torch"
    if attention_backend == "triton" and not on_cuda:
        raise ValueError("--attention-backend triton needs a CUDA device (use torch on CPU)")
    if segment_kernels not in ("auto", "on", "off"):
        raise ValueError(f"segment_kernels must be auto, on or off, got {segment_kernels!r}")
    on = segment_kernels == "on" or (segment_kernels == "auto" and attention_backend == "triton")
    return attention_backend, on


def resolve_prefix_caching(a: ServerArgs) -> bool:
    """Whether the schedulers cache prefixes: as asked (--enable-prefix-caching, or off with
    --disable-radix-cache), else on; every combination of the other settings runs with it."""
    if a.enable_prefix_caching is not None:
        return a.enable_prefix_caching
    return not a.disable_radix_cache


def resolve_load_balance_method(a: ServerArgs) -> str:
    """The DP router's method ("auto" made concrete); the controller needs it before the
    ranks resolve the rest."""
    if a.load_balance_method != "auto":
        return a.load_balance_method
    return "cache_aware" if resolve_prefix_caching(a) and a.dp_size > 1 else "round_robin"


def _validate(a: ServerArgs) -> None:
    """Checks of single values and of cross-field rules the user states explicitly."""
    for name, choices in (
        ("dtype", DTYPES), ("device", DEVICES), ("load_format", LOAD_FORMATS),
        ("quant_numerics", QUANT_NUMERICS), ("kv_cache_dtype", KV_CACHE_DTYPES),
        ("attention_backend", ATTENTION_BACKENDS), ("schedule_policy", SCHEDULE_POLICIES),
        ("load_balance_method", LOAD_BALANCE_METHODS), ("dp_idle_policy", DP_IDLE_POLICIES),
        ("log_level", LOG_LEVELS), ("moe_dispatcher", MOE_DISPATCHERS), ("moe_backend", MOE_BACKENDS),
        ("tool_call_parser", TOOL_CALL_PARSERS), ("reasoning_parser", REASONING_PARSERS),
    ):
        if getattr(a, name) is None and name in _DEFAULT_AT_RESOLVE:
            continue
        if getattr(a, name) not in choices:
            raise ValueError(f"--{flag_name(name)} must be one of {', '.join(choices)}, got {getattr(a, name)!r}")
    if not isinstance(a.disable_overlap_schedule, bool):
        raise ValueError(f"--disable-overlap-schedule must be true or false, got {a.disable_overlap_schedule!r}")
    if a.enable_prefix_caching is not None and not isinstance(a.enable_prefix_caching, bool):
        raise ValueError(f"--enable-prefix-caching must be true or false (or unset: on), "
                         f"got {a.enable_prefix_caching!r}")
    if not isinstance(a.disable_radix_cache, bool):
        raise ValueError(f"--disable-radix-cache must be true or false, got {a.disable_radix_cache!r}")
    if a.enable_prefix_caching is True and a.disable_radix_cache:
        raise ValueError("--enable-prefix-caching and --disable-radix-cache contradict each other: "
                         "--disable-radix-cache turns prefix caching off; give one of them")
    if not a.prefix_cache_state_gb > 0:
        raise ValueError(f"--prefix-cache-state-gb must be positive, got {a.prefix_cache_state_gb}")
    if not isinstance(a.model_path, str) or not a.model_path:
        raise ValueError("--model-path must be a preset name or a checkpoint directory")
    if a.page_size <= 0 or a.page_size % 128:
        raise ValueError(f"--page-size must be a multiple of 128 (the c128 block), got {a.page_size}")
    for name in ("num_layers", "context_length", "max_running_requests", "max_total_tokens", "breakable_cuda_graph_max_tokens",
                 "cuda_graph_max_bs"):
        v = getattr(a, name)
        if v is not None and v <= 0:
            raise ValueError(f"--{flag_name(name)} must be positive, got {v}")
    if a.max_total_tokens is not None and a.max_total_tokens < a.page_size:
        raise ValueError(f"--max-total-tokens must be at least one page ({a.page_size}), got {a.max_total_tokens}")
    if a.chunked_prefill_size is not None and a.chunked_prefill_size != -1 and a.chunked_prefill_size <= 0:
        raise ValueError(f"--chunked-prefill-size must be positive or -1 (no chunking), got {a.chunked_prefill_size}")
    if not 0 < a.mem_fraction_static <= 1:
        raise ValueError(f"--mem-fraction-static must be in (0, 1], got {a.mem_fraction_static}")
    if a.breakable_cuda_graph_tokens is not None and (
        not a.breakable_cuda_graph_tokens or any(t <= 0 for t in a.breakable_cuda_graph_tokens)
    ):
        raise ValueError(f"--breakable-cuda-graph-tokens must be positive integers, got {a.breakable_cuda_graph_tokens}")
    if a.cuda_graph_bs is not None:
        if not a.cuda_graph_bs or any(not isinstance(b, int) or b <= 0 for b in a.cuda_graph_bs):
            raise ValueError(f"--cuda-graph-bs must be positive integers, got {a.cuda_graph_bs}")
        if a.cuda_graph_max_bs is not None and max(a.cuda_graph_bs) > a.cuda_graph_max_bs:
            raise ValueError(f"--cuda-graph-bs has {max(a.cuda_graph_bs)}, above --cuda-graph-max-bs "
                             f"{a.cuda_graph_max_bs}: give one of them")
    if a.dp_size < 1:
        raise ValueError(f"--dp-size must be >= 1, got {a.dp_size}")
    if a.load_balance_method == "cache_aware" and not resolve_prefix_caching(a):
        raise ValueError("--load-balance-method cache_aware routes by what the ranks' prefix caches hold: "
                         "it needs prefix caching, which --disable-radix-cache turns off")
    if not isinstance(a.load_balance_max_imbalance, int) or a.load_balance_max_imbalance < 0:
        raise ValueError(f"--load-balance-max-imbalance must be an integer >= 0, got {a.load_balance_max_imbalance!r}")
    _validate_speculative(a)
    if a.dp_size > 1 and not a.enable_dp_attention:
        raise ValueError("--dp-size > 1 needs --enable-dp-attention (DP here is data-parallel attention)")
    if a.nnodes < 1:
        raise ValueError(f"--nnodes must be >= 1, got {a.nnodes}")
    if not 0 <= a.node_rank < a.nnodes:
        raise ValueError(f"--node-rank must be in [0, {a.nnodes}), got {a.node_rank}")
    if a.segment_kernels not in SEGMENT_KERNELS:
        raise ValueError(f"--segment-kernels must be one of {SEGMENT_KERNELS}, got {a.segment_kernels!r}")
    if a.nnodes > 1 and not a.dist_init_addr:
        raise ValueError("--nnodes > 1 needs --dist-init-addr (host:port of node 0)")
    if a.dp_size % a.nnodes:
        raise ValueError(f"--dp-size ({a.dp_size}) must be divisible by --nnodes ({a.nnodes}): "
                         "each node runs the same number of DP ranks")
    if a.dist_init_addr is not None:
        _check_dist_init_addr(a.dist_init_addr)
    if not 0 <= a.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {a.port}")
    if a.stream_interval < 1:
        raise ValueError(f"--stream-interval must be >= 1, got {a.stream_interval}")
    if a.max_request_bytes < 1024:
        raise ValueError(f"--max-request-bytes must be at least 1024, got {a.max_request_bytes}")
    if a.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0, got {a.shutdown_timeout}")
    if a.watchdog_timeout <= 0:
        raise ValueError(f"--watchdog-timeout must be positive, got {a.watchdog_timeout}")


def _validate_speculative(a: ServerArgs) -> None:
    if a.speculative_algorithm not in SPECULATIVE_ALGORITHMS:
        raise ValueError(f"--speculative-algorithm must be one of {', '.join(map(str, SPECULATIVE_ALGORITHMS[1:]))} "
                         f"(or unset), got {a.speculative_algorithm!r}")
    if a.speculative_num_steps is not None and a.speculative_algorithm is None:
        raise ValueError("--speculative-num-steps needs --speculative-algorithm mtp")
    steps = a.speculative_num_steps
    if steps is not None and (not isinstance(steps, int) or not 1 <= steps <= SPECULATIVE_MAX_STEPS):
        raise ValueError(f"--speculative-num-steps must be an integer in [1, {SPECULATIVE_MAX_STEPS}], "
                         f"got {a.speculative_num_steps!r}")


# Choice fields whose unset value (None) resolve() replaces with a default of its own.
_DEFAULT_AT_RESOLVE = {"kv_cache_dtype"}


def _check_dist_init_addr(addr: str) -> None:
    host, sep, port = addr.rpartition(":")
    # port + 1 is node 0's DP controller (managers/dp/supervisor.py)
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65534:
        raise ValueError(f"--dist-init-addr must be host:port with a port in [1, 65534], got {addr!r}")


def _decode_graph_sizes(sizes: Optional[Tuple[int, ...]], max_running: int) -> Optional[Tuple[int, ...]]:
    """--cuda-graph-bs sorted, without the sizes no decode batch can reach (above the running
    requests); an error when none is left."""
    if not sizes:
        return None
    kept = tuple(sorted({b for b in sizes if b <= max_running}))
    if not kept:
        raise ValueError(f"--cuda-graph-bs {list(sizes)}: every size is above --max-running-requests {max_running}, "
                         f"so no decode batch would replay a graph")
    return kept


def flag_name(name: str) -> str:
    """A field's command-line flag without its dashes (`max_total_tokens` -> `max-total-tokens`)."""
    return name.replace("_", "-")


def _query_gpu_free_memory() -> int:
    import torch

    free, _total = torch.cuda.mem_get_info()
    return free


__all__: List[str] = ["ServerArgs", "flag_name"]
