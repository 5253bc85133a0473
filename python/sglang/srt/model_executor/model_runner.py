"""ModelRunner: owns the model, the KV pools, the attention backend and the graph runners;
runs one forward (ForwardBatch + path in, logits out). The path comes from graph_dispatch.py:
the runner decides it for itself (a world of one) or receives the DP consensus's.

Be paranoid about adding lines here: this is the hot path. Rare features live in helpers.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from sglang.srt.configs.deepseek_v4 import load_model_config
from sglang.srt.layers.attention.deepseek_v4_backend import DeepseekV4AttnBackend
from sglang.srt.layers.dp_attention import DPMoEContext, expert_shard
from sglang.srt.layers.logits_processor import LogitsOutput, compute_logits
from sglang.srt.layers.quantization import QuantMode
from sglang.srt.mem_cache.dsv4_kv_pool import DSV4KVPool
from sglang.srt.mem_cache.memory_planner import capture_oom_error, log_memory_before_capture, report_startup_memory
from sglang.srt.mem_cache.req_to_token_pool import ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.model_executor.forward_context import forward_context
from sglang.srt.model_executor.graph_dispatch import (
    GraphTables,
    PathKind,
    StepPath,
    decide_step_path,
    default_capture_bs,
    default_capture_num_tokens,
    describe,
)
from sglang.srt.model_executor.graph_tables_check import require_same_capture_tables
from sglang.srt.model_loader.random_init import init_random_weights
from sglang.srt.model_loader.safetensors_io import load_checkpoint
from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM
from sglang.srt.server_args import resolve_kernels

logger = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


@dataclass(frozen=True)
class ModelRunnerConfig:
    """What the runner needs from the server arguments, with every "auto" resolved."""

    model_path: str = "dsv4-tiny"
    load_format: str = "auto"  # "auto": checkpoint for directories, seeded random for presets
    num_layers: Optional[int] = None  # only the first N layers (configs/deepseek_v4.with_num_layers)
    # "release": the release's activation/KV/indexer rounding on release-format weights;
    # "weight_only": quantized weights on unrounded activations. The runner resolves it to
    # "weight_only" for a model without quantized weights (runner_config holds the resolved value).
    quant_numerics: str = "release"
    kv_cache_dtype: str = "auto"  # "auto" (the model dtype) | "fp8_e4m3" (nope dims e4m3, per-64 scales)
    dtype: str = "float32"
    device: str = "cpu"
    random_seed: int = 0
    context_length: int = 1024
    page_size: int = 128
    max_num_reqs: int = 16
    max_total_tokens: int = 16384
    mem_fraction_static: float = 0.8  # for the start-up memory plan (mem_cache/memory_planner.py)
    chunked_prefill_size: int = 2048
    enable_breakable_cuda_graph: bool = False
    breakable_cuda_graph_max_tokens: int = 512
    breakable_cuda_graph_tokens: Optional[Sequence[int]] = None
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int = 16
    debug_cuda_graph: bool = False
    attention_backend: str = "auto"  # "torch" | "triton" | "auto" (Triton kernels on CUDA)
    # dsv4_kernels ops for the in-segment pieces too: "auto" exactly when the attention core
    # runs on Triton; "on" forces them (CPU: their torch references), "off" keeps torch.
    segment_kernels: str = "auto"
    # Decode graphs are on by default on CUDA; tests turn the CPU emulator on explicitly.
    cuda_graph_on_cpu: bool = False
    # DP attention (the process groups are set up before the runner: distributed/parallel_state.py)
    dp_size: int = 1
    dp_idle_policy: str = "replay"
    moe_dispatcher: str = "gather"  # layers/moe/ep_dispatch.py: "gather" (all-gather / reduce-scatter) | "deepep"

    @staticmethod
    def from_server_args(args) -> "ModelRunnerConfig":
        if isinstance(args, ModelRunnerConfig):
            return args
        names = {f.name for f in dataclasses.fields(ModelRunnerConfig)}
        kw = {n: getattr(args, n) for n in names if hasattr(args, n)}
        if hasattr(args, "max_running_requests"):
            kw["max_num_reqs"] = args.max_running_requests
        return ModelRunnerConfig(**kw)


class ModelRunner:
    def __init__(self, server_args):
        cfg = ModelRunnerConfig.from_server_args(server_args)
        self.device = torch.device(cfg.device)
        free_before = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else None
        self.dtype = _DTYPES[cfg.dtype]
        self.config = load_model_config(cfg.model_path, cfg.num_layers)
        if cfg.kv_cache_dtype not in ("auto", "fp8_e4m3"):
            raise ValueError(f"kv_cache_dtype must be auto or fp8_e4m3, got {cfg.kv_cache_dtype!r}")
        # A bf16 model has nothing to round: release numerics are the release format's.
        cfg = dataclasses.replace(cfg, quant_numerics=QuantMode.resolve_numerics(self.config, cfg.quant_numerics))
        self.runner_config = cfg
        self.max_context_len = min(cfg.context_length, self.config.max_position_embeddings)
        self.max_num_reqs = cfg.max_num_reqs
        self.dp_groups = None
        expert_range = self._expert_shard_for_dp(cfg) if cfg.dp_size > 1 else None
        self.model = self._load_model(cfg, expert_range)
        num_pages = 1 + -(-cfg.max_total_tokens // cfg.page_size)  # + the padding page
        self.req_to_token_pool = ReqToTokenPool(cfg.max_num_reqs, self.max_context_len, num_pages,
                                                cfg.page_size, self.device)
        self.kv_pool = DSV4KVPool(self.config, num_pages * cfg.page_size, cfg.max_num_reqs, self.dtype, self.device,
                                  kv_cache_dtype=cfg.kv_cache_dtype, round_nope_fp8=cfg.quant_numerics == "release")
        kernels, segment_kernels = resolve_kernels(cfg.attention_backend, cfg.segment_kernels, self.device)
        self.attn_backend = DeepseekV4AttnBackend(self.config, self.kv_pool, self.req_to_token_pool,
                                                  max_seq_len=self.max_context_len, kernels=kernels,
                                                  segment_kernels=segment_kernels)
        self.stats = {"forward_eager": 0}
        self.graph_runners = {}  # PathKind -> GraphRunner
        self._init_graph_runners(cfg)
        self.graph_tables = GraphTables(
            bcg_buckets=self.bcg_runner.buckets if self.bcg_runner else (),
            decode_bs_buckets=self.decode_graph_runner.buckets if self.decode_graph_runner else (),
            idle_policy=cfg.dp_idle_policy)
        self.memory_plan = report_startup_memory(self, free_before)

    def _init_graph_runners(self, cfg: ModelRunnerConfig) -> None:
        from sglang.srt.model_executor.graph_runner import BREAKABLE, DECODE, GraphRunner

        if cfg.enable_breakable_cuda_graph:
            buckets = cfg.breakable_cuda_graph_tokens or default_capture_num_tokens(cfg.breakable_cuda_graph_max_tokens)
            self.graph_runners[PathKind.BCG] = GraphRunner(self, BREAKABLE, buckets, debug=cfg.debug_cuda_graph)
        if not cfg.disable_cuda_graph and (self.device.type == "cuda" or cfg.cuda_graph_on_cpu):
            buckets = default_capture_bs(min(cfg.cuda_graph_max_bs, self.max_num_reqs))
            self.graph_runners[PathKind.DECODE_GRAPH] = GraphRunner(self, DECODE, buckets, debug=cfg.debug_cuda_graph)
        if self.dp_groups is not None:  # every rank, with graphs or not: the gather is collective
            # Capture runs the MoE collectives once per bucket: ranks with other buckets would
            # abort gloo (or hang NCCL) inside capture, so compare the tables first.
            require_same_capture_tables(self.dp_groups.cpu_group, cfg.dp_size, GraphTables(
                bcg_buckets=self.bcg_runner.buckets if self.bcg_runner else (),
                decode_bs_buckets=self.decode_graph_runner.buckets if self.decode_graph_runner else ()))
        log_memory_before_capture(self)
        for runner in self.graph_runners.values():
            try:
                runner.capture()
            except torch.OutOfMemoryError as e:  # at start-up, never mid-serving: say what to change
                raise capture_oom_error(self, runner) from e

    @property
    def bcg_runner(self):
        return self.graph_runners.get(PathKind.BCG)

    @property
    def decode_graph_runner(self):
        return self.graph_runners.get(PathKind.DECODE_GRAPH)

    def _expert_shard_for_dp(self, cfg: ModelRunnerConfig):
        """This DP rank's routed experts [start, end): the model is built at that size and the
        loader reads only those experts' tensors."""
        from sglang.srt.distributed.parallel_state import get_dp_groups

        from sglang.srt.layers.moe.ep_dispatch import create_moe_dispatcher

        self.moe_dispatcher = create_moe_dispatcher(cfg.moe_dispatcher)  # fails first if it cannot run
        self.dp_groups = get_dp_groups()
        if self.dp_groups is None or self.dp_groups.dp_size != cfg.dp_size:
            raise RuntimeError("DP attention: call init_dp_groups() before building the ModelRunner")
        # MTP layers' experts are sharded too (the model builds them at this range): never
        # run here, but loaded, and at Pro size their experts are 13 GB.
        return expert_shard(self.config.n_routed_experts, self.dp_groups.dp_rank, cfg.dp_size)

    def dp_moe(self, pad_tokens: int):
        """The MoE's DP context for a step whose ranks each contribute `pad_tokens` rows."""
        if self.dp_groups is None:
            return None
        g = self.dp_groups
        return DPMoEContext(g.device_group, g.dp_rank, g.dp_size, pad_tokens, self.moe_dispatcher)

    def _load_model(self, cfg: ModelRunnerConfig, expert_range) -> DeepseekV4ForCausalLM:
        """Built on the device at its final (sharded, quantized) size, then filled in place:
        seeded random weights (dummy) or the checkpoint, streamed tensor by tensor."""
        with torch.device(self.device):
            model = DeepseekV4ForCausalLM(self.config, self.dtype, max_positions=self.max_context_len + 1,
                                          quant_numerics=cfg.quant_numerics, expert_range=expert_range)
        from_dir = os.path.isdir(cfg.model_path)
        if cfg.load_format == "dummy" or (cfg.load_format == "auto" and not from_dir):
            init_random_weights(model, cfg.random_seed)
        else:
            load_checkpoint(model, cfg.model_path)
        return model.to_device(self.device).eval()

    @torch.inference_mode()
    def forward(self, forward_batch: ForwardBatch, path: Optional[StepPath] = None) -> LogitsOutput:
        """Run the batch on `path` (graph kind + bucket, or eager). Without one, the runner
        decides for itself as a world of one; under DP attention every rank passes the path
        the ranks agreed on (managers/dp_sync.dp_step), idle ranks with an empty batch."""
        fb = forward_batch
        if path is None:
            path = decide_step_path((describe(fb),), self.graph_tables)
        if path.kind == PathKind.IDLE:
            raise ValueError("forward() got the IDLE path: no rank has work, so nobody runs a forward")
        if self.dp_groups is not None:
            self._count_dp_step(path)
        runner = self.graph_runners.get(path.kind)
        if runner is not None:
            return compute_logits(self.model, runner.replay_hidden(fb, path.size), fb)
        if path.kind != PathKind.EAGER:
            raise ValueError(f"forward() got path {path.kind.name} but no such graphs were captured")
        fallback_of = self.graph_runners.get(path.wanted)
        if fallback_of is not None:  # counted, logged once per reason: a log line per step is too many
            fallback_of.fallbacks[path.reason] += 1
            level = logging.INFO if fallback_of.fallbacks[path.reason] == 1 else logging.DEBUG
            logger.log(level, "%s fallback to eager (%s): %d tokens, %s", fallback_of.spec.name, path.reason,
                       fb.num_tokens, fb.forward_mode.name)
        self.stats["forward_eager"] += 1
        self.attn_backend.init_forward_metadata(fb)
        with forward_context(fb, self.attn_backend, dp_moe=self.dp_moe(path.size)):
            hidden = self.model(fb.input_ids, fb.input_embeds)
        return compute_logits(self.model, hidden, fb)

    def _count_dp_step(self, path: StepPath) -> None:
        key = {PathKind.BCG: "dp_bcg_steps", PathKind.DECODE_GRAPH: "dp_decode_graph_steps",
               PathKind.EAGER: "dp_eager_steps"}[path.kind]
        self.stats[key] = self.stats.get(key, 0) + 1
        if path.extend_or_mixed:  # the steps BCG is for; the replayed share is what we report
            self.stats["dp_extend_steps"] = self.stats.get("dp_extend_steps", 0) + 1

    def get_stats(self) -> dict:
        # Which kernels run: the first thing to check when a GPU step is slower than expected.
        out = dict(self.stats, attention_kernels=self.attn_backend.kernels,
                   segment_kernels=self.attn_backend.segment_kernels)
        for runner in self.graph_runners.values():
            out.update(runner.get_stats())
        return out

    def shutdown(self) -> None:
        for runner in self.graph_runners.values():
            runner.release()
        self.graph_runners = {}
