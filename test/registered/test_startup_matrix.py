"""Start-up matrix: every --attention-backend x --segment-kernels choice, on a release-format
checkpoint (conformance-tiny-fp8fp4: FP8 linears, FP4 experts) and a bf16 one
(conformance-tiny), with graphs on and off. Each combination is either refused by
ServerArgs.resolve with a ValueError naming the flag, or starts a ModelRunner that serves a
short greedy request.

Every combination is resolved (for a CPU and for a GPU); the distinct resolved ones are started:
on the CPU with the torch core, where "graphs on" is the CPU graph emulator (decode and
breakable graphs), which refuses what a CUDA capture refuses (host syncs, host-to-device
copies) and serves the same tokens as eager; on CUDA (gpu) with both cores."""

from __future__ import annotations

import gc
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "models"))
from dsv4_harness import Session, run_step  # noqa: E402

from sglang.srt.model_executor.model_runner import ModelRunner  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

MODELS = {"release": "conformance-tiny-fp8fp4", "bf16": "conformance-tiny"}
ATTENTION = ("auto", "torch", "triton")
SEGMENT = ("auto", "on", "off")
PROMPT = [5, 17, 301, 42, 77, 9, 250, 3, 131, 64, 8, 400]
NEW_TOKENS = 3


def _args(model_dir: Path, device: str, attention: str, segment: str, graphs: bool) -> ServerArgs:
    return ServerArgs(
        model_path=str(model_dir), device=device, attention_backend=attention, segment_kernels=segment,
        context_length=256, max_total_tokens=1024, max_running_requests=2, chunked_prefill_size=256,
        disable_cuda_graph=not graphs, cuda_graph_max_bs=1,
        enable_breakable_cuda_graph=graphs, breakable_cuda_graph_tokens=(16,),
    )


def _resolve(model_dir: Path, device: str, attention: str, segment: str, graphs: bool) -> ServerArgs:
    return _args(model_dir, device, attention, segment, graphs).resolve(cuda_available=device == "cuda")


def _greedy(args: ServerArgs, graphs: bool) -> tuple[list[int], ModelRunner]:
    """The prompt (one 12-token prefill: the 16-token breakable-graph bucket with graphs on),
    then NEW_TOKENS - 1 decode steps (decode graph bucket 1), each taking the argmax."""
    runner = ModelRunner(args, cuda_graph_on_cpu=graphs)
    if graphs:
        assert runner.decode_graph_runner is not None and runner.breakable_runner is not None
    s = Session(runner)
    out, tokens = run_step(runner, [s], [PROMPT]), []
    for _ in range(NEW_TOKENS):
        logits = out.next_token_logits[0].float()
        assert torch.isfinite(logits).all()
        tokens.append(int(logits.argmax()))
        if len(tokens) < NEW_TOKENS:
            out = run_step(runner, [s], [[tokens[-1]]])
    s.release()
    return tokens, runner


@pytest.fixture(scope="module")
def reference_dir(dsv4_reference_dir):
    return dsv4_reference_dir


def _release_gpu():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---- what every combination resolves to, or why it is refused ---------------------------------


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_every_combination_resolves_or_is_refused_naming_the_flag(reference_dir, model, device):
    """Resolution only (cuda_available=True resolves for a GPU on any machine): on a CPU the
    Triton core is refused naming the flag and "auto" is the torch core; on CUDA nothing is
    refused and "auto" is the Triton core. Segment kernels "auto" follow the core; "on" and
    "off" are taken as given. A release checkpoint's FP4 experts follow the segment kernels
    (the torch reference without them, the Triton kernel with them on CUDA: humming is not
    installed here); bf16 experts likewise."""
    model_dir = reference_dir / MODELS[model]
    for attention in ATTENTION:
        for segment in SEGMENT:
            for graphs in (False, True):
                if device == "cpu" and attention == "triton":
                    with pytest.raises(ValueError, match=r"^--attention-backend triton needs a CUDA device"):
                        _resolve(model_dir, device, attention, segment, graphs)
                    continue
                r = _resolve(model_dir, device, attention, segment, graphs)
                core = attention if attention != "auto" else ("triton" if device == "cuda" else "torch")
                on = segment == "on" or (segment == "auto" and core == "triton")
                assert (r.attention_backend, r.segment_kernels) == (core, "on" if on else "off")
                assert r.disable_cuda_graph is not graphs and r.enable_breakable_cuda_graph is graphs
                if importlib.util.find_spec("humming") is None:
                    assert r.moe_backend == ("triton" if device == "cuda" and on else "torch")


# ---- CPU: the distinct resolved combinations start and serve ----------------------------------


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("segment", ["on", "off"])
def test_cpu_starts_and_serves_with_graphs_on_and_off(reference_dir, model, segment):
    model_dir = reference_dir / MODELS[model]
    eager, runner = _greedy(_resolve(model_dir, "cpu", "torch", segment, False), False)
    assert all(0 <= t < runner.config.vocab_size for t in eager)
    graphed, _ = _greedy(_resolve(model_dir, "cpu", "torch", segment, True), True)
    # the emulator replays the captured ops: the same logits, so the same tokens
    assert graphed == eager


# ---- GPU: the distinct combinations on CUDA -----------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("attention,segment", [("auto", "auto"), ("triton", "on"), ("triton", "off"),
                                               ("torch", "on"), ("torch", "off")])
def test_gpu_starts_and_serves_with_graphs_on_and_off(reference_dir, model, attention, segment):
    """On CUDA with the server's defaults (bf16 activations): the Triton and torch cores, with
    and without segment kernels, start with decode and breakable graphs (whose capture refuses
    host-to-device copies) and without, and serve a greedy request."""
    model_dir = reference_dir / MODELS[model]
    for graphs in (False, True):
        tokens, runner = _greedy(_resolve(model_dir, "cuda", attention, segment, graphs), graphs)
        assert len(tokens) == NEW_TOKENS and all(0 <= t < runner.config.vocab_size for t in tokens)
        del runner
        _release_gpu()
