"""The command line of ServerArgs (`python -m sglang.launch_server`): a parser built from
ServerArgs' fields, each flag with its type, its choices and its help text (HELP, by field name:
what the flag does, what its values mean and what "auto" resolves to)."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Optional, Sequence

from sglang.srt.server_args import (
    ATTENTION_BACKENDS, DEVICES, DP_IDLE_POLICIES, DTYPES, KV_CACHE_DTYPES, LOAD_BALANCE_METHODS, LOAD_FORMATS,
    LOG_LEVELS, MOE_BACKENDS, MOE_DISPATCHERS, QUANT_NUMERICS, REASONING_PARSERS, SCHEDULE_POLICIES,
    SEGMENT_KERNELS, SPECULATIVE_ALGORITHMS, SPECULATIVE_DEFAULT_STEPS, SPECULATIVE_MAX_STEPS, TOOL_CALL_PARSERS,
    ServerArgs, flag_name,
)

HELP = {
    "segment_kernels": "the in-segment DSV4 pieces (mHC, q RMS+RoPE, KV norm+RoPE+cache write, inverse RoPE, "
                       "compressors, indexer, MoE) through sgl-kernel's dsv4_kernels ops: auto = exactly when the "
                       "attention backend resolves to triton; on = also elsewhere (on CPU: their torch "
                       "references); off = the model's own torch code",
    "moe_backend": "who multiplies the FP4 routed experts of release-format models: humming (humming-kernels' "
                   "W4A8 / W4A16 GEMMs; CUDA, compute capability 9.0+, bf16 models; the optional extra "
                   "sglang-dsv4[humming]), triton (sgl-kernel's FP4 MoE), torch (the reference); auto = humming "
                   "where it can run, else triton with segment kernels, else torch. bf16 experts follow "
                   "--segment-kernels (only auto)",
    "model_path": "preset name (dsv4-tiny, dsv4-mini, dsv4-flash-slice, dsv4-flash, or a release-format "
                  "*-fp8 variant of the first three) or a directory with config.json and *.safetensors "
                  "[+ tokenizer.json]",
    "tokenizer_path": "tokenizer.json or a directory holding one (default: the model directory's, else bytes)",
    "load_format": "auto: dummy (seeded random weights, in the release format for dsv4-flash and the *-fp8 "
                   "presets) for presets, safetensors for directories",
    "num_layers": "run only the model's first N layers at full dims (compress-ratio pattern and MTP "
                  "entry kept), for when the whole model does not fit; needs --load-format dummy",
    "dtype": "auto: bfloat16 on CUDA, float32 on CPU",
    "random_seed": "seed of the random weights of --load-format dummy and of the sampler for requests "
                   "without a seed of their own (default 0)",
    "quant_numerics": "release-format weights (FP8 linears, FP4 experts): release reproduces the release's "
                      "rounding (activations to FP8 per 128, KV nope dims to FP8 per 64, indexer q/k Hadamard + "
                      "FP4 per 32); weight_only runs the quantized weights on unrounded activations. A bf16 model "
                      "has nothing to round: it always runs weight_only",
    "kv_cache_dtype": "how KV entries are cached: auto = in the model dtype; fp8_e4m3 = nope dims as e4m3 with a "
                      "power-of-two scale per 64, rope dims in the model dtype (584 instead of 1024 bytes per bf16 "
                      "entry). Default: fp8_e4m3 when the model runs the release numerics (release-format weights "
                      "with --quant-numerics release, whose KV rounding keeps exactly those values), else auto",
    "device": "auto: cuda when available, else cpu",
    "host": "address the HTTP server listens on (default 127.0.0.1, this machine only; 0.0.0.0 for every "
            "interface)",
    "port": "HTTP port (default 30000); checked free before the model loads",
    "served_model_name": "the model id /v1/models lists and OpenAI requests may name (default: --model-path, "
                         "which requests may always name)",
    "context_length": "default: min(max_position_embeddings, 4096)",
    "page_size": "tokens per KV page (a multiple of 128)",
    "max_running_requests": "default: 64 on CPU, 256 on CUDA",
    "max_total_tokens": "KV capacity in tokens; default: from free GPU memory on CUDA, "
                        "min(context * max running, 65536) on CPU",
    "mem_fraction_static": "fraction of free GPU memory for weights + KV cache",
    "chunked_prefill_size": "max prefill tokens per step (default 2048 CUDA / 256 CPU; -1: no chunking)",
    "schedule_policy": "order in which waiting requests are admitted: fcfs (first come, first served) or lpm "
                       "(longest cached prefix first, arrival order among equals; needs prefix caching; with more "
                       "than 128 waiting requests a step admits fcfs, as matching them all would cost more)",
    "enable_mixed_chunk": "run a prefill chunk and the running decodes in one MIXED forward",
    "disable_overlap_schedule": "process each step's sampled tokens before launching the next step (by default "
                                "the host schedules and launches step N+1 while the GPU runs step N, and "
                                "finish checks and outputs lag one step)",
    "enable_prefix_caching": "reuse the KV pages of prompt prefixes earlier requests computed (a radix tree "
                             "over token ids, matched at page boundaries where a request's compressor state "
                             "was saved, or where a finished request's computed tokens end; least recently "
                             "used prefixes are evicted when pages run short); on by default: the flag only "
                             "states it, --disable-radix-cache turns it off",
    "prefix_cache_state_gb": "host memory (GiB per DP rank; pinned on CUDA) for the state the prefix cache keeps "
                             "at each cached prefix's end: the window's raw KV rows and the compressors' rings, "
                             "3.9 to 14.4 MiB each at DeepSeek-V4-Flash; past it the least recently used "
                             "prefixes are evicted",
    "disable_radix_cache": "turn prefix caching off (SGLang's switch; on by default); contradicts "
                           "--enable-prefix-caching",
    "attention_backend": "the attention core: triton (sgl-kernel's Triton kernels; CUDA only) or torch (the "
                         "plain-torch reference); auto = triton on CUDA when triton imports, else torch",
    "enable_breakable_cuda_graph": "replay extend and mixed batches (prefill chunks, alone or with decodes) from "
                                   "breakable graphs captured at token buckets up to "
                                   "--breakable-cuda-graph-max-tokens: captured segments replay, attention runs "
                                   "eagerly between them; a batch above the largest bucket or padded too much "
                                   "runs eagerly. On CPU an emulator records and replays the segments",
    "breakable_cuda_graph_max_tokens": "largest breakable-graph bucket (default 4096 CUDA / 512 CPU)",
    "breakable_cuda_graph_tokens": "explicit breakable-graph token buckets (default: a ladder up to "
                                   "--breakable-cuda-graph-max-tokens, neighbours at most 2x apart)",
    "cuda_graph_max_bs": "largest decode graph batch size (default 256 CUDA / 16 CPU)",
    "cuda_graph_bs": "explicit decode-graph batch sizes (default: a ladder up to --cuda-graph-max-bs); a decode "
                     "batch pads to the next one, and runs eagerly above the largest or beyond "
                     "--max-running-requests",
    "disable_cuda_graph": "run decode batches eagerly instead of replaying decode CUDA graphs (captured on "
                          "CUDA only, for batch sizes up to --cuda-graph-max-bs)",
    "debug_cuda_graph": "check at every graph replay that no break op's tensor argument moved since capture "
                        "(an error instead of a silent wrong answer); under DP attention also verify every "
                        "step's path decision across ranks (one extra small all-gather per step)",
    "enable_dp_attention": "data-parallel attention: --dp-size scheduler processes, each with its own batch, "
                           "KV cache and 1/dp of the routed experts, exchanging MoE rows through "
                           "--moe-dispatcher",
    "dp_size": "DP attention ranks (scheduler processes, one GPU each); needs --enable-dp-attention",
    "load_balance_method": "how the DP controller picks a rank: round_robin; least_loaded (fewest "
                           "outstanding requests, then tokens); cache_aware (needs prefix caching: the "
                           "rank holding the most pages of the prompt's prefix, by the controller's record of "
                           "the prompts it sent each rank, unless that rank has more than "
                           "--load-balance-max-imbalance outstanding requests above the least loaded one; no "
                           "holder: least_loaded); auto = cache_aware with prefix caching (on unless "
                           "--disable-radix-cache) and --dp-size > 1, else round_robin (default auto)",
    "load_balance_max_imbalance": "cache_aware: how many more outstanding requests than the least loaded "
                                  "rank a rank holding a longer cached prefix may have and still get the "
                                  "request (0: only among the least loaded)",
    "dp_idle_policy": "steps where some DP rank has no work: replay (idle ranks replay the graph the busy "
                      "ranks take, with zero real tokens) or eager (every rank runs that step eagerly)",
    "moe_dispatcher": "how DP ranks exchange MoE rows (each holds 1/dp of the routed experts): gather "
                      "(all-gather every rank's rows, run the local experts, reduce-scatter the sums; "
                      "captured in graphs)",
    "speculative_algorithm": "mtp: speculative decoding with the model's own MTP layer: it drafts "
                             "--speculative-num-steps tokens per running request, one target step verifies them "
                             "all (an extend: breakable graphs replay it) and keeps the longest prefix the target "
                             "agrees with (greedy), or accepts by the speculative-sampling rule (temperature > 0), "
                             "so outputs follow the target's distribution. Runs without overlap scheduling. Unset: "
                             "off",
    "nnodes": "nodes the DP ranks span (--dp-size must be a multiple)",
    "node_rank": "this node's index; node 0 runs the HTTP server, the others only their DP ranks",
    "dist_init_addr": "host:port of node 0 for the torch.distributed rendezvous; node 0's DP "
                      "controller also listens on port+1",
    "max_request_bytes": "largest HTTP request body; larger ones get 413 before they are buffered",
    "shutdown_timeout": "seconds in-flight requests may take to finish after SIGTERM; streams still "
                        "open then end with an error event",
    "stream_interval": "stream every N tokens (always on finish)",
    "tool_call_parser": "how /v1/chat/completions reads tool calls: deepseekv4 (or deepseek_v4) parses the "
                        "model's DSML blocks into message.tool_calls; none refuses requests with tools",
    "reasoning_parser": "how /v1/chat/completions reads reasoning: deepseek-v4 (or deepseek_v4) returns the "
                        "text before </think> as reasoning_content; none leaves it in content",
    "watchdog_timeout": "seconds a forward may take before the server is considered hung",
    "log_level": "logging level of the server and scheduler processes",
    "speculative_num_steps": f"tokens the MTP layer drafts per step, 1..{SPECULATIVE_MAX_STEPS} (default "
                             f"{SPECULATIVE_DEFAULT_STEPS} with --speculative-algorithm)",
}


_CHOICES = {
    "load_format": LOAD_FORMATS, "dtype": DTYPES, "device": DEVICES, "attention_backend": ATTENTION_BACKENDS,
    "quant_numerics": QUANT_NUMERICS, "kv_cache_dtype": KV_CACHE_DTYPES,
    "schedule_policy": SCHEDULE_POLICIES, "load_balance_method": LOAD_BALANCE_METHODS,
    "dp_idle_policy": DP_IDLE_POLICIES, "log_level": LOG_LEVELS, "moe_dispatcher": MOE_DISPATCHERS,
    "segment_kernels": SEGMENT_KERNELS, "moe_backend": MOE_BACKENDS, "speculative_algorithm": SPECULATIVE_ALGORITHMS[1:],
    "tool_call_parser": TOOL_CALL_PARSERS, "reasoning_parser": REASONING_PARSERS,
}
_INT_FIELDS = {"load_balance_max_imbalance", "num_layers", "random_seed", "port", "context_length", "page_size", "max_running_requests", "max_total_tokens",
               "chunked_prefill_size", "breakable_cuda_graph_max_tokens", "cuda_graph_max_bs", "dp_size", "nnodes",
               "node_rank", "stream_interval", "max_request_bytes", "speculative_num_steps"}
_FLOAT_FIELDS = {"mem_fraction_static", "watchdog_timeout", "shutdown_timeout", "prefix_cache_state_gb"}


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    for f in dataclasses.fields(ServerArgs):
        if f.name == "resolved":
            continue
        flag, help_ = f"--{flag_name(f.name)}", HELP.get(f.name)
        if help_ is not None and f.default not in (None, False) and "default" not in help_:
            help_ += f" (default {f.default})"
        if f.type in ("bool", bool):
            parser.add_argument(flag, action="store_true", help=help_)
        elif f.type in ("Optional[bool]", Optional[bool]):  # unset (None): resolve() decides
            parser.add_argument(flag, action="store_true", default=None, help=help_)
        elif f.name in ("breakable_cuda_graph_tokens", "cuda_graph_bs"):
            parser.add_argument(flag, type=int, nargs="+", default=None, help=help_)
        else:
            kind = int if f.name in _INT_FIELDS else float if f.name in _FLOAT_FIELDS else str
            parser.add_argument(flag, type=kind, default=f.default, choices=_CHOICES.get(f.name), help=help_)


def from_cli_args(args: argparse.Namespace) -> ServerArgs:
    names = [f.name for f in dataclasses.fields(ServerArgs) if f.name != "resolved"]
    return ServerArgs(**{n: getattr(args, n) for n in names if hasattr(args, n)})


def make_parser() -> argparse.ArgumentParser:
    """The command line of `python -m sglang.launch_server`."""
    parser = argparse.ArgumentParser(prog="python -m sglang.launch_server", description="DeepSeek-V4 serving runtime")
    add_cli_args(parser)
    return parser


def prepare_server_args(argv: Sequence[str]) -> ServerArgs:
    """Parse a command line into (unresolved) ServerArgs; the launcher resolves it once it
    knows whether CUDA is available."""
    return from_cli_args(make_parser().parse_args(list(argv)))
