"""ModelRunner: owns the model, the KV pools, the attention backend and the graph runners;
runs one forward (ForwardBatch + path in, logits out). The path comes from graph_dispatch.py:
the runner decides it for itself (a world of one) or receives the DP consensus's.

Be paranoid about adding lines here: this is the hot path. Rare features live in helpers.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from sglang.srt.configs.loader import load_model_config
from sglang.srt.layers.attention.deepseek_v4_backend import DeepseekV4AttnBackend
from sglang.srt.layers.dp_attention import DPMoEContext, expert_shard
from sglang.srt.layers.logits_processor import LogitsOutput, compute_logits
from sglang.srt.layers.moe.ep_dispatch import create_moe_dispatcher
from sglang.srt.mem_cache.dsv4_kv_pool import DSV4KVPool
from sglang.srt.model_executor.memory_report import (
    capture_oom_error,
    log_memory_before_capture,
    report_kv_capacity,
    report_startup_memory,
)
from sglang.srt.mem_cache.req_to_token_pool import ReqToTokenPool
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.model_executor.forward_context import forward_context
from sglang.srt.model_executor.graph_dispatch import (
    GraphTables,
    PathKind,
    StepInfo,
    StepPath,
    decide_step_path,
    default_capture_bs,
    default_capture_num_tokens,
    describe,
)
from sglang.srt.model_executor.graph_tables_check import require_same_capture_tables
from sglang.srt.model_executor.mtp_graph_runner import build_mtp_graph_runners, mtp_graph_tables
from sglang.srt.model_loader.random_init import init_random_weights
from sglang.srt.model_loader.safetensors_io import load_checkpoint
from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM
from sglang.srt.server_args import ServerArgs, resolve_kernels

logger = logging.getLogger(__name__)

class ModelRunner:
    """Built from resolved `ServerArgs` (server_args.py), the one source of every setting and
    default; the runner reads them from `self.server_args` and never restates one.

    `cuda_graph_on_cpu` is no server flag: decode graphs are captured on CUDA only, unless a
    test asks for them on the CPU emulator (which has CUDA-graph semantics) with this."""

    def __init__(self, server_args: ServerArgs, *, cuda_graph_on_cpu: bool = False):
        if not isinstance(server_args, ServerArgs):
            raise TypeError(f"ModelRunner takes ServerArgs, got {type(server_args).__name__}")
        if not server_args.resolved:
            raise ValueError("ModelRunner needs resolved ServerArgs: call server_args.resolve(cuda_available=...) "
                             "first (sglang.test.runner_args.cpu_server_args does for tests)")
        args = self.server_args = server_args
        self.device = torch.device(args.device)
        free_before = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else None
        self.dtype = args.torch_dtype
        # the MTP modules speculative decoding runs, and no others (ServerArgs.run_config)
        self.config = args.run_config(load_model_config(args.model_path, args.num_layers))
        self.max_context_len = args.context_length  # resolve() checked it against the model
        self.dp_groups = None
        expert_range = self._expert_shard_for_dp(args) if args.dp_size > 1 else None
        self.model = self._load_model(args, expert_range)
        num_pages = 1 + -(-args.max_total_tokens // args.page_size)  # + the padding page
        self.req_to_token_pool = ReqToTokenPool(args.max_running_requests, self.max_context_len, num_pages,
                                                args.page_size, self.device)
        # speculative decoding runs the MTP layers: they keep caches like any layer
        self.num_mtp_layers = self.config.num_mtp_layers
        self.kv_pool = DSV4KVPool(self.config, num_pages * args.page_size, args.max_running_requests, self.dtype, self.device,
                                  num_layers=self.config.num_hidden_layers + self.num_mtp_layers,
                                  kv_cache_dtype=args.kv_cache_dtype, round_nope_fp8=args.quant_numerics == "release",
                                  index_keys_fp4=args.quant_numerics == "release",
                                  max_step_tokens=args.max_step_tokens)
        if self.num_mtp_layers:  # before capture: graphs write the streams into this buffer
            c = self.config
            self.model.streams_out = torch.empty(args.max_step_tokens, c.hc_mult, c.hidden_size, dtype=self.dtype,
                                                 device=self.device)
        kernels, segment_kernels = resolve_kernels(args.attention_backend, args.segment_kernels, self.device)
        self.attn_backend = DeepseekV4AttnBackend(self.config, self.kv_pool, self.req_to_token_pool,
                                                  max_seq_len=self.max_context_len, kernels=kernels,
                                                  segment_kernels=segment_kernels)
        self.stats = {"forward_eager": 0}
        self.graph_runners = {}  # PathKind -> its GraphRunner subclass
        self._init_graph_runners(args, cuda_graph_on_cpu)
        self.graph_tables = GraphTables(
            breakable_buckets=self.breakable_runner.buckets if self.breakable_runner else (),
            decode_bs_buckets=self.decode_graph_runner.buckets if self.decode_graph_runner else (),
            idle_policy=args.dp_idle_policy)
        self.memory_plan = report_startup_memory(self, free_before)
        self.kv_capacity = report_kv_capacity(self)

    def _init_graph_runners(self, args: ServerArgs, cuda_graph_on_cpu: bool) -> None:
        from sglang.srt.model_executor.graph_runner import BreakableCudaGraphRunner, DecodeCudaGraphRunner

        if args.enable_breakable_cuda_graph:
            buckets = args.breakable_cuda_graph_tokens or default_capture_num_tokens(args.breakable_cuda_graph_max_tokens)
            self.graph_runners[PathKind.BREAKABLE] = BreakableCudaGraphRunner(self, buckets, debug=args.debug_cuda_graph)
        if not args.disable_cuda_graph and (self.device.type == "cuda" or cuda_graph_on_cpu):
            buckets = list(args.cuda_graph_bs or default_capture_bs(min(args.cuda_graph_max_bs,
                                                                           args.max_running_requests)))
            self.graph_runners[PathKind.DECODE_GRAPH] = DecodeCudaGraphRunner(self, buckets, debug=args.debug_cuda_graph)
        if self.dp_groups is not None:  # every rank, with graphs or not: the gather is collective
            # Capture runs the MoE collectives once per bucket: ranks with other buckets would
            # abort gloo (or hang NCCL) inside capture, so compare the tables first.
            require_same_capture_tables(self.dp_groups.cpu_group, args.dp_size, GraphTables(
                breakable_buckets=self.breakable_runner.buckets if self.breakable_runner else (),
                decode_bs_buckets=self.decode_graph_runner.buckets if self.decode_graph_runner else ()))
        # the MTP layer's own graphs (speculative decoding), captured after the target's
        self.mtp_graph_runners = build_mtp_graph_runners(self)
        self.mtp_graph_tables = mtp_graph_tables(self.mtp_graph_runners)
        log_memory_before_capture(self)
        for runner in list(self.graph_runners.values()) + list(self.mtp_graph_runners.values()):
            try:
                runner.capture()
            except torch.OutOfMemoryError as e:  # at start-up, never mid-serving: say what to change
                raise capture_oom_error(self, runner) from e

    @property
    def breakable_runner(self):
        return self.graph_runners.get(PathKind.BREAKABLE)

    @property
    def decode_graph_runner(self):
        return self.graph_runners.get(PathKind.DECODE_GRAPH)

    def _expert_shard_for_dp(self, args: ServerArgs):
        """This DP rank's routed experts [start, end): the model is built at that size and the
        loader reads only those experts' tensors."""
        from sglang.srt.distributed.parallel_state import get_dp_groups

        self.moe_dispatcher = create_moe_dispatcher(args.moe_dispatcher)  # fails first if it cannot run
        self.dp_groups = get_dp_groups()
        if self.dp_groups is None or self.dp_groups.dp_size != args.dp_size:
            raise RuntimeError("DP attention: call init_dp_groups() before building the ModelRunner")
        # MTP layers' experts are sharded too (the model builds them at this range): never
        # run here, but loaded, and at Pro size their experts are 13 GB.
        return expert_shard(self.config.n_routed_experts, self.dp_groups.dp_rank, args.dp_size)

    def dp_moe(self, pad_tokens: int):
        """The MoE's DP context for a step whose ranks each contribute `pad_tokens` rows."""
        if self.dp_groups is None:
            return None
        g = self.dp_groups
        return DPMoEContext(g.device_group, g.dp_rank, g.dp_size, pad_tokens, self.moe_dispatcher)

    def _load_model(self, args: ServerArgs, expert_range) -> DeepseekV4ForCausalLM:
        """Built on the device at its final (sharded, quantized) size, then filled in place:
        seeded random weights (dummy) or the checkpoint, streamed tensor by tensor."""
        with torch.device(self.device):
            model = DeepseekV4ForCausalLM(self.config, self.dtype, max_positions=self.max_context_len + 1,
                                          quant_numerics=args.quant_numerics, expert_range=expert_range)
        if args.load_format == "dummy":  # resolve(): "auto" is dummy for presets, safetensors for directories
            init_random_weights(model, args.random_seed)
        else:
            load_checkpoint(model, args.model_path)
        model = model.to_device(self.device).eval()
        model.use_tensor_core_gemms()  # bf16 on CUDA: split / bf16 weights derived from the loaded ones
        model.stack_input_linears()  # FP8 linears on one input: one weight tensor, one decode GEMV
        model.use_moe_backend(args.moe_backend)  # resolved: humming / triton / torch
        return model

    @torch.inference_mode()
    def forward(self, forward_batch: ForwardBatch, path: Optional[StepPath] = None) -> LogitsOutput:
        """Run the batch on `path` (graph kind + bucket, or eager). Without one, the runner
        decides for itself as a world of one; under DP attention every rank passes the path
        the ranks agreed on (model_executor/dp_sync.dp_step), idle ranks with an empty batch."""
        return compute_logits(self.model, self.forward_hidden(forward_batch, path), forward_batch)

    @torch.inference_mode()
    def forward_hidden(self, forward_batch: ForwardBatch, path: Optional[StepPath] = None) -> torch.Tensor:
        """forward() up to the final hidden states (at least num_live_tokens rows: a graph's
        are its bucket's); callers that need logits of other rows than each request's last
        (speculative verification) take them from here."""
        fb = forward_batch
        if path is None:
            path = decide_step_path((describe(fb),), self.graph_tables)
        if path.kind == PathKind.IDLE:
            raise ValueError("forward() got the IDLE path: no rank has work, so nobody runs a forward")
        if self.dp_groups is not None:
            self._count_dp_step(path)
        runner = self.graph_runners.get(path.kind)
        if runner is not None:
            return runner.replay_hidden(fb, path.size)
        if path.kind != PathKind.EAGER:
            raise ValueError(f"forward() got path {path.kind.name} but no such graphs were captured")
        fallback_of = self.graph_runners.get(path.wanted)
        if fallback_of is not None:
            fallback_of.count_fallback(path.reason, fb)
        self.stats["forward_eager"] += 1
        self.attn_backend.init_forward_metadata(fb)
        with forward_context(fb, self.attn_backend, dp_moe=self.dp_moe(path.size)):
            return self.model(fb.input_ids, fb.input_embeds)

    @torch.inference_mode()
    def forward_mtp(self, forward_batch: ForwardBatch, streams: torch.Tensor, k: int = 0,
                    path: Optional[StepPath] = None) -> tuple:
        """MTP layer k over the batch (its input_ids: the token after each position) and the
        residual streams [T, hc, d] of each position: (output streams, final hidden), at least
        T rows (a graph's are its bucket's). The module replays its graphs where one fits
        (mtp_graph_runner.py), the rest runs eagerly. Without DP the runner decides the
        path itself. Under DP attention every rank calls it with the path the ranks agreed
        (`mtp_path`), idle ones with an empty batch: the MTP layer's MoE is collective."""
        fb = forward_batch
        if not self.num_mtp_layers:
            raise ValueError("the MTP layers run only with --speculative-algorithm mtp (without it the KV pool "
                             "holds no caches for them)")
        if not 0 <= k < self.num_mtp_layers:
            raise ValueError(f"MTP module {k}: this runner runs modules 0..{self.num_mtp_layers - 1}")
        if self.dp_groups is not None and path is None:
            raise ValueError("forward_mtp under DP attention needs the agreed path (ModelRunner.mtp_path)")
        self.stats["forward_mtp"] = self.stats.get("forward_mtp", 0) + 1
        if path is None:
            path = self.mtp_path(describe(fb))
        runner = self.mtp_graph_runners.get((k, path.kind))
        if runner is not None:
            return runner.replay_mtp(fb, streams, path.size)
        if (k, path.wanted) in self.mtp_graph_runners:
            self.mtp_graph_runners[(k, path.wanted)].count_fallback(path.reason, fb)
        self.attn_backend.init_forward_metadata(fb)
        with forward_context(fb, self.attn_backend, dp_moe=self.dp_moe(path.size)):
            return self.model.forward_mtp(k, streams, fb.input_ids)

    def mtp_path(self, rows: StepInfo) -> StepPath:
        """How an MTP forward of `rows` runs: a graph of its kind and bucket, or eager padded to
        rows.num_tokens. Under DP every rank passes the same bound (the largest rank's rows),
        so every rank decides the same."""
        return decide_step_path((rows,), self.mtp_graph_tables)

    def _count_dp_step(self, path: StepPath) -> None:
        key = {PathKind.BREAKABLE: "dp_breakable_steps", PathKind.DECODE_GRAPH: "dp_decode_graph_steps",
               PathKind.EAGER: "dp_eager_steps"}[path.kind]
        self.stats[key] = self.stats.get(key, 0) + 1
        if path.extend_or_mixed:  # the steps breakable graphs are for; the replayed share is what we report
            self.stats["dp_extend_steps"] = self.stats.get("dp_extend_steps", 0) + 1

    def copy_kv_page(self, src: int, dst: int) -> None:
        """Page `dst` of every paged KV cache becomes a copy of page `src` (prefix caching's tails)."""
        self.kv_pool.copy_page(src, dst, self.req_to_token_pool.page_size)

    def get_stats(self) -> dict:
        # Which kernels run: the first thing to check when a GPU step is slower than expected.
        out = dict(self.stats, **self.kv_capacity, attention_kernels=self.attn_backend.kernels,
                   segment_kernels=self.attn_backend.segment_kernels)
        for runner in list(self.graph_runners.values()) + list(self.mtp_graph_runners.values()):
            out.update(runner.get_stats())
        if self.device.type == "cuda":
            # this process's own device memory (the caching allocator, graph pools included):
            # unlike the device-wide free figure, other processes on the GPU do not move it
            out["device_memory_reserved_bytes"] = torch.cuda.memory_reserved(self.device)
            out["device_memory_allocated_bytes"] = torch.cuda.memory_allocated(self.device)
        return out

    def shutdown(self) -> None:
        for runner in list(self.graph_runners.values()) + list(self.mtp_graph_runners.values()):
            runner.release()
        self.graph_runners, self.mtp_graph_runners, self.mtp_graph_tables = {}, {}, GraphTables()
