"""Offline engine: tokenizer, model runner and scheduler in this process, no server.

`Engine(...).generate(prompts, sampling_params)` queues every prompt at once and steps the
scheduler until they all finish, so a list of prompts is served as one continuous batch.

With `enable_dp_attention=True, dp_size=N` the schedulers run in N processes, as in the
server (managers/dp/controller.py); `_DPSchedulerClient` stands in for the scheduler here, over
the same `ControllerClient` as the server's TokenizerManager.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from typing import Any, Dict, List, Sequence, Union

import torch

from sglang.srt.managers.io_struct import (
    GenerateReqInput,
    OutputsSoFar,
    ServerInfo,
    TokenOut,
    check_prompt_ids,
    kv_capacity_tokens,
    output_text,
)
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs
from sglang.srt.tokenizer import get_tokenizer

logger = logging.getLogger(__name__)

Prompt = Union[str, List[int]]


class Engine:
    def __init__(self, model_path: str = "dsv4-tiny", **server_arg_overrides: Any):
        args = ServerArgs(model_path=model_path, **server_arg_overrides)
        self._rids = itertools.count()
        self._closed = False
        if args.dp_size > 1:
            self._init_dp(args)
            return
        from sglang.srt.model_executor.model_runner import ModelRunner  # heavy: the model

        self.server_args = args.resolve(cuda_available=torch.cuda.is_available())
        self.model_runner = ModelRunner(self.server_args)
        self.tokenizer = get_tokenizer(self.server_args.model_path, self.server_args.tokenizer_path)
        self.scheduler = Scheduler(self.server_args, self.model_runner, decode_fn=self.tokenizer.decode)

    def _init_dp(self, args: ServerArgs) -> None:
        from sglang.srt.managers.dp.controller_client import ControllerClient
        from sglang.srt.managers.dp.controller import DataParallelController

        if args.nnodes > 1:
            raise ValueError("the offline Engine runs on one node: use launch_server for --nnodes > 1")
        controller = DataParallelController(args)
        ready = controller.launch()
        self.server_args = ready.server_args
        self.model_runner = None  # in the rank processes
        self.tokenizer = get_tokenizer(self.server_args.model_path, self.server_args.tokenizer_path)
        self.scheduler = _DPSchedulerClient(ControllerClient(controller), ready)

    # ---- generation ------------------------------------------------------------------

    def generate(
        self,
        prompt: Union[Prompt, Sequence[Prompt], None] = None,
        sampling_params: Union[Dict[str, Any], SamplingParams, Sequence[Any], None] = None,
        input_ids: Union[List[int], List[List[int]], None] = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
    ) -> Union[Dict[str, Any], List[Dict[str, Any]]]:
        """prompt: a str, a list of str, token ids, or a list of token-id lists (or pass
        input_ids=). Returns one dict per prompt, a list when a list was given:
        {"text", "output_ids", "meta_info": {"prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason"}}.
        return_logprob / top_logprobs_num: meta_info also holds `output_token_logprobs` (and
        `output_top_logprobs`), as /generate returns them. Bad input raises ValueError and
        queues nothing."""
        self._check_open()
        if (prompt is None) == (input_ids is None):
            raise ValueError("pass exactly one of prompt and input_ids")
        prompts, single = _as_prompt_list(prompt if prompt is not None else input_ids)
        params = _as_params_list(sampling_params, len(prompts))
        reqs = [
            GenerateReqInput(rid=f"engine-{next(self._rids)}",
                             input_ids=self.tokenizer.encode(p) if isinstance(p, str) else list(p),
                             sampling_params=sp, return_logprob=return_logprob, top_logprobs_num=top_logprobs_num)
            for p, sp in zip(prompts, params)
        ]
        added = []
        try:
            for r in reqs:
                self.scheduler.add_request(r)
                added.append(r.rid)
        except ValueError:
            # all or nothing; generate() is synchronous, so only these requests are queued
            for rid in added:
                self.scheduler.abort_request(rid)
            while self.scheduler.has_work():
                self.scheduler.step()
            raise
        results = self._run_until_finished(reqs)
        outs = [results[r.rid] for r in reqs]
        return outs[0] if single else outs

    def _run_until_finished(self, reqs: List[GenerateReqInput]) -> Dict[str, dict]:
        acc = {r.rid: OutputsSoFar(r.return_logprob, r.top_logprobs_num) for r in reqs}
        rids = list(acc)
        results: Dict[str, dict] = {}
        while len(results) < len(rids):
            if not self.scheduler.has_work():
                raise RuntimeError(f"scheduler went idle with unfinished requests {sorted(set(rids) - set(results))}")
            for out in self.scheduler.step():
                if out.rid in acc:
                    acc[out.rid].add(out.new_token_ids, out.new_logprobs, out.new_top_logprobs)
                    if out.finished:
                        results[out.rid] = self._result(acc[out.rid], out)
        return results

    def _result(self, acc: OutputsSoFar, out) -> Dict[str, Any]:
        meta = {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
                "cached_tokens": out.cached_tokens, "finish_reason": out.finish_reason}
        if out.error:
            meta["error"] = out.error
        meta.update(acc.meta_info())
        return {"text": output_text(self.tokenizer.decode, acc.ids, out.finish_reason),
                "output_ids": acc.ids, "meta_info": meta}

    # ---- lifecycle and info ----------------------------------------------------------

    def get_server_info(self) -> Dict[str, Any]:
        """Server args and the scheduler's stats; under DP the sums over ranks, and each rank's
        own in `dp_rank_stats`."""
        self._check_open()
        if isinstance(self.scheduler, _DPSchedulerClient):
            from sglang.srt.managers.dp.stats import aggregate_stats

            per_rank = self.scheduler.get_rank_stats()
            return {"server_args": dataclasses.asdict(self.server_args), **aggregate_stats(per_rank),
                    "dp_rank_stats": per_rank}
        return {"server_args": dataclasses.asdict(self.server_args), **self.scheduler.get_stats()}

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if isinstance(self.scheduler, _DPSchedulerClient):
            self.scheduler.shutdown()  # each rank releases its graphs, then its process groups
        shutdown = getattr(self.model_runner, "shutdown", None)
        if shutdown is not None:
            shutdown()
        self.scheduler = None
        self.model_runner = None

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the engine was shut down")

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


class _DPSchedulerClient:
    """The scheduler calls the Engine makes (add_request, abort_request, has_work, step), served
    by the DP ranks' processes through the ControllerClient: requests go to the rank the
    controller picks, and step() waits for the next outputs any rank sends."""

    def __init__(self, client, ready):
        self.client = client
        self.vocab_size = ready.vocab_size
        self.context_length = ready.context_length
        self.kv_capacity = kv_capacity_tokens(ready.stats)
        self.timeout_s = ready.server_args.watchdog_timeout
        self._held: List[TokenOut] = []  # outputs read while waiting for stats

    @property
    def controller(self):
        return self.client.controller

    def add_request(self, req: GenerateReqInput) -> None:
        """The scheduler's own request checks, so bad input raises here as it does without DP."""
        req.sampling_params.verify(self.vocab_size)
        check_prompt_ids(req.input_ids, self.vocab_size, self.context_length, self.kv_capacity)
        self.client.submit(req)

    def abort_request(self, rid: str) -> bool:
        return self.client.abort(rid)

    def has_work(self) -> bool:
        return self.client.num_outstanding > 0

    def step(self) -> List[TokenOut]:
        outs, self._held = self._held, []
        if not outs:
            outs = [o for _, msg in self.client.read(self.timeout_s) if not isinstance(msg, ServerInfo) for o in msg]
        self.client.on_outputs(outs)
        return outs

    def get_rank_stats(self) -> List[dict]:
        n = self.client.dp_size
        self.client.request_server_info()
        stats: Dict[int, dict] = {}
        while len(stats) < n:
            for rank, msg in self.client.read(self.timeout_s):
                if isinstance(msg, ServerInfo):
                    stats[rank] = msg.stats
                else:
                    self._held.extend(msg)
        return [stats[r] for r in range(n)]

    def shutdown(self) -> None:
        self.client.shutdown()


def _as_prompt_list(prompt) -> tuple:
    """(list of prompts, whether a single prompt was given)."""
    if isinstance(prompt, str):
        return [prompt], True
    if not isinstance(prompt, (list, tuple)) or not prompt:
        raise ValueError("prompt must be a string, token ids, or a non-empty list of them")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return [list(prompt)], True
    if all(isinstance(p, str) or isinstance(p, (list, tuple)) for p in prompt):
        return list(prompt), False
    raise ValueError("prompt must be a string, token ids, or a non-empty list of them")


def _as_params_list(sampling_params, n: int) -> List[SamplingParams]:
    if isinstance(sampling_params, (list, tuple)):
        if len(sampling_params) != n:
            raise ValueError(f"{len(sampling_params)} sampling_params for {n} prompts")
        return [_as_params(p) for p in sampling_params]
    return [_as_params(sampling_params) for _ in range(n)]


def _as_params(p) -> SamplingParams:
    if isinstance(p, SamplingParams):
        return dataclasses.replace(p)  # the scheduler keeps it; the caller may reuse theirs
    return SamplingParams.from_dict(p)
