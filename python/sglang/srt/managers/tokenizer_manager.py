"""TokenizerManager: the server process's side of the schedulers. It tokenizes and validates
requests, ships each to the scheduler process (the DP rank) the controller picks, routes
TokenOut back to per-request asyncio queues, detokenizes incrementally, aborts requests whose
client went away, and fails every in-flight request (and reports it) if a scheduler process
dies."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from sglang.srt.managers.dp.controller_client import ControllerClient
from sglang.srt.managers.dp.controller import DataParallelController
from sglang.srt.managers.dp.stats import KV_CAPACITY_STATS, aggregate_stats
from sglang.srt.managers.io_struct import (
    GenerateReqInput,
    OutputsSoFar,
    ReadyMsg,
    ServerInfo,
    check_logprob_args,
    check_prompt_ids,
    kv_capacity_tokens,
    visible_output_ids,
)
from sglang.srt.metrics import ServerMetrics
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.tokenizer import IncrementalDetokenizer, get_tokenizer

logger = logging.getLogger(__name__)

WATCHDOG_INTERVAL_S = 1.0
# After a scheduler process died the others may sit in a collective: do not wait long for them.
SHUTDOWN_AFTER_DEATH_S = 1.0


class RequestError(ValueError):
    """Bad client input: HTTP 400."""


class SchedulerDiedError(RuntimeError):
    """A scheduler process is gone: HTTP 503, and the server exits."""


class ShuttingDownError(RuntimeError):
    """The server drains after SIGTERM: HTTP 503 with Retry-After for new requests, and the end
    of the streams still open when --shutdown-timeout runs out."""


@dataclass
class GenerateOutput:
    """One chunk of a request's output, as the HTTP layer sees it."""

    rid: str
    text: str  # text completed since the previous chunk
    output_ids: list[int]  # token ids generated since the previous chunk
    finished: bool
    finish_reason: dict | None
    prompt_tokens: int
    completion_tokens: int
    # with return_logprob: per token of output_ids, and its top (logprob, id) pairs
    output_logprobs: list[float] | None = None
    output_top_logprobs: list[list[tuple[float, int]]] | None = None
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache


@dataclass
class _ReqState:
    detokenizer: IncrementalDetokenizer
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)


class TokenizerManager:
    def __init__(self, server_args):
        self.server_args = server_args
        self.tokenizer = get_tokenizer(server_args.model_path, getattr(server_args, "tokenizer_path", None))
        self.served_model_name = getattr(server_args, "served_model_name", None) or server_args.model_path
        self.context_length: int | None = None  # from the scheduler's ready message
        self.vocab_size: int | None = None
        self.kv_capacity: int | None = None  # KV tokens per rank, from the ready message
        self.rid_to_state: dict[str, _ReqState] = {}
        self.dead = False
        self.death_message = ""
        self.draining = False  # set by drain(): no new requests
        self._closing = False
        self.client: ControllerClient | None = None  # the DP controller's, from launch()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._death_event: asyncio.Event | None = None
        self._info_waiters: list[collections.deque[asyncio.Future]] = []
        self.metrics = ServerMetrics()  # /metrics: per-request latencies here, scheduler gauges at scrape

    # ---- process lifecycle --------------------------------------------------------------

    def launch(self, timeout_s: float | None = None) -> ReadyMsg:
        """Start the scheduler processes (one per DP rank) and block until every model is
        ready; raise RuntimeError with the failing process's traceback if start-up fails."""
        self.client = ControllerClient(DataParallelController(self.server_args),
                                       on_send_error=lambda rank: self._to_loop(self._on_scheduler_exit, rank))
        self._info_waiters = [collections.deque() for _ in range(self.client.dp_size)]
        msg = self.client.controller.launch(timeout_s)
        self.server_args = msg.server_args
        self.context_length, self.vocab_size = msg.context_length, msg.vocab_size
        self.kv_capacity = kv_capacity_tokens(msg.stats)
        return msg

    def start_io(self, loop: asyncio.AbstractEventLoop) -> asyncio.Event:
        """Start the reader threads and the watchdog on `loop`; the returned event is set if a
        scheduler process dies."""
        self._loop = loop
        self._death_event = asyncio.Event()
        # Blocking reads off the event loop; each message is handed to the loop thread.
        self.client.start_readers(on_message=lambda rank, msg: self._to_loop(self._dispatch, rank, msg),
                                  on_exit=lambda rank: self._to_loop(self._on_scheduler_exit, rank))
        self._watchdog_task = loop.create_task(self._watchdog())  # held: the loop keeps weak refs
        return self._death_event

    def shutdown(self, timeout_s: Optional[float] = None) -> None:
        """Stop the scheduler processes: ask, then terminate, then kill (None: the supervisor's
        grace period). Never leaves one behind."""
        self._closing = True
        if self.client is not None:
            self.client.shutdown(SHUTDOWN_AFTER_DEATH_S if self.dead else timeout_s)

    async def drain(self, timeout_s: float, poll_s: float = 0.05) -> int:
        """Refuse new requests, wait up to `timeout_s` for the in-flight ones to finish, then end
        the rest with ShuttingDownError and wait (briefly) for their handlers to let go. Returns
        how many had to be ended."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.rid_to_state and loop.time() < deadline:
            await asyncio.sleep(poll_s)
        left = len(self.rid_to_state)
        err = ShuttingDownError(f"the server shut down before this request finished (--shutdown-timeout {timeout_s:g} s)")
        for state in self.rid_to_state.values():
            state.queue.put_nowait(err)
        deadline = loop.time() + 2.0
        while self.rid_to_state and loop.time() < deadline:  # the handlers write their last event
            await asyncio.sleep(poll_s)
        return left

    @property
    def scheduler_pid(self) -> int | None:
        return self.client.controller.pids[0] if self.client is not None else None

    def _to_loop(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass  # the event loop is closed: the server is shutting down

    async def _watchdog(self) -> None:
        # The readers' EOF normally reports a death first; this catches a child that is gone
        # while its pipe somehow stays open.
        while not self.dead:
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
            rank = self.client.controller.first_dead_rank()
            if rank is not None:
                self._on_scheduler_exit(rank)

    def _on_scheduler_exit(self, rank: int) -> None:
        if self.dead or self._closing:
            return
        self.dead = True
        self.death_message = self.client.controller.death_message(rank)
        logger.error("%s; failing %d in-flight request(s)", self.death_message, len(self.rid_to_state))
        err = SchedulerDiedError(self.death_message)
        for state in self.rid_to_state.values():
            state.queue.put_nowait(err)
        for waiters in self._info_waiters:
            while waiters:
                fut = waiters.popleft()
                if not fut.done():
                    fut.set_exception(err)
        self._death_event.set()

    def _dispatch(self, rank: int, msg) -> None:
        if isinstance(msg, ServerInfo):
            fut = self._info_waiters[rank].popleft()
            if not fut.done():
                fut.set_result(msg)
            return
        self.client.on_outputs(msg)
        for out in msg:  # a list of TokenOut from one scheduler step
            state = self.rid_to_state.get(out.rid)
            if state is not None:  # else: aborted, its late outputs are dropped
                state.queue.put_nowait(out)

    def _abort(self, rid: str) -> None:
        self.client.abort(rid)  # a no-op when it already finished

    # ---- requests -----------------------------------------------------------------------

    def tokenize(self, text: str) -> list[int]:
        # No BOS is added to raw prompts: the DSV4 release sets add_bos_token false (its chat
        # encoding writes BOS itself), and the offline Engine encodes the same way.
        return self.tokenizer.encode(text, add_special_tokens=False)

    def build_request(
        self,
        input_ids: Sequence[int],
        sampling_params: dict | None,
        stream: bool = False,
        rid: str | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
    ) -> tuple[GenerateReqInput, bool]:
        """Validate and build a request; returns it with its `skip_special_tokens`.
        Raises RequestError (HTTP 400) for any bad input."""
        ids = self._check_input_ids(input_ids)
        sp = {} if sampling_params is None else sampling_params
        if not isinstance(sp, dict):
            raise RequestError("sampling_params must be a JSON object")
        sp = dict(sp)
        skip_special_tokens = sp.pop("skip_special_tokens", True)
        if not isinstance(skip_special_tokens, bool):
            raise RequestError("skip_special_tokens must be true or false")
        explicit_max = sp.get("max_new_tokens") is not None
        try:
            params = SamplingParams.from_dict(sp)
            params.verify(self.vocab_size)
        except (TypeError, ValueError) as e:
            raise RequestError(str(e)) from None
        # Refused before any work what could never finish: a request that outgrows the context
        # or the whole KV pool would otherwise run and fail (or be cut) at the limit.
        for limit, what in ((self.context_length, "the context length"),
                            (self.kv_capacity, "the KV cache (--max-total-tokens)")):
            if limit is None or params.max_new_tokens <= limit - len(ids):
                continue
            if explicit_max:
                raise RequestError(
                    f"the prompt ({len(ids)} tokens) plus max_new_tokens ({params.max_new_tokens}) "
                    f"exceeds {what} ({limit} tokens)"
                )
            params.max_new_tokens = limit - len(ids)  # an unset limit fills what there is
        if rid is not None and not isinstance(rid, str):
            raise RequestError("rid must be a string")
        rid = rid or uuid.uuid4().hex
        try:
            check_logprob_args(return_logprob, top_logprobs_num)
        except ValueError as e:
            raise RequestError(str(e)) from None
        return GenerateReqInput(rid=rid, input_ids=ids, sampling_params=params, stream=stream,
                                return_logprob=return_logprob, top_logprobs_num=top_logprobs_num), skip_special_tokens

    def _check_input_ids(self, input_ids) -> list[int]:
        try:
            return check_prompt_ids(input_ids, self.vocab_size, self.context_length, self.kv_capacity)
        except ValueError as e:
            raise RequestError(str(e)) from None

    async def generate(self, req: GenerateReqInput, skip_special_tokens: bool = True) -> AsyncIterator[GenerateOutput]:
        """Send `req` and yield its output chunks until it finishes. Closing the generator
        early (client gone, handler cancelled) aborts the request in the scheduler."""
        if self.dead:
            raise SchedulerDiedError(self.death_message)
        if self.draining:
            raise ShuttingDownError("the server is shutting down")
        rid = req.rid
        # The controller owns a rid until the scheduler's final output for it arrives, which can
        # be after its client has gone (an abort still in flight): reusing it before then would
        # hand the new request the old one's abort and leave the new one running unobserved.
        if rid in self.rid_to_state or self.client.owns(rid):
            raise RequestError(f"request id {rid!r} is already in use")
        state = _ReqState(IncrementalDetokenizer(self.tokenizer, skip_special_tokens, req.sampling_params.stop))
        self.rid_to_state[rid] = state
        self.client.submit(req)
        timer = self.metrics.start_request()
        finished, failed, prompt_tokens = False, False, 0
        try:
            while not finished:
                items = [await state.queue.get()]
                while not state.queue.empty():  # under load, fold queued steps into one chunk
                    items.append(state.queue.get_nowait())
                try:
                    out = self._fold(req, state.detokenizer, items)
                except BaseException:
                    failed = True
                    raise
                finished, prompt_tokens = out.finished, out.prompt_tokens
                timer.chunk(len(out.output_ids))
                if finished:
                    timer.finish((out.finish_reason or {}).get("type", "stop"), prompt_tokens)
                yield out
        finally:
            self.rid_to_state.pop(rid, None)
            # a client that went away (or a cancelled handler) is an abort; a failed step an error
            timer.finish("error" if failed else "abort", prompt_tokens)
            if not finished and not self.dead:
                self._abort(rid)

    def _fold(self, req: GenerateReqInput, detok: IncrementalDetokenizer, items: list) -> GenerateOutput:
        text, last = [], None
        outs = OutputsSoFar(req.return_logprob, req.top_logprobs_num)
        finish_reason = None
        finished = False
        for item in items:
            if isinstance(item, BaseException):
                raise item
            if item.error is not None:
                raise RequestError(item.error)
            outs.add(item.new_token_ids, item.new_logprobs, item.new_top_logprobs)
            # A matched stop token ends the text; it is not part of it (it stays in the ids).
            visible = visible_output_ids(item.new_token_ids, item.finish_reason) if item.finished else item.new_token_ids
            text.append(detok.add(visible))
            last = item
            if item.finished:
                finished, finish_reason = True, item.finish_reason
                break
            if detok.stopped:
                # A stop string the scheduler has not acted on yet: end here, free its slot.
                finished, finish_reason = True, {"type": "stop", "matched": detok.matched_stop}
                self._abort(req.rid)
                break
        if finished:
            text.append(detok.finish())
        return GenerateOutput(
            rid=req.rid,
            text="".join(text),
            output_ids=outs.ids,
            finished=finished,
            finish_reason=finish_reason,
            prompt_tokens=last.prompt_tokens,
            completion_tokens=last.completion_tokens,
            output_logprobs=outs.logprobs,
            output_top_logprobs=outs.top_logprobs,
            cached_tokens=last.cached_tokens,
        )

    async def scheduler_stats(self, timeout_s: float = 30.0) -> list[dict]:
        """Each DP rank's live scheduler stats (Scheduler.get_stats), in rank order."""
        if self.dead:
            raise SchedulerDiedError(self.death_message)
        futs = [self._loop.create_future() for _ in self._info_waiters]
        for waiters, fut in zip(self._info_waiters, futs):
            waiters.append(fut)
        self.client.request_server_info()
        return [info.stats for info in await asyncio.wait_for(asyncio.gather(*futs), timeout_s)]

    async def metrics_text(self, timeout_s: float = 30.0) -> tuple[bytes, str]:
        """The Prometheus exposition (metrics.py), the schedulers' gauges read now."""
        self.metrics.observe_schedulers(await self.scheduler_stats(timeout_s))
        return self.metrics.render()

    async def get_server_info(self, timeout_s: float = 30.0) -> dict:
        """Server args plus the schedulers' live stats (graph replays, fallbacks, ...): summed over
        DP ranks in `scheduler_stats`, each rank's own in `dp_rank_stats`."""
        per_rank = await self.scheduler_stats(timeout_s)
        stats = aggregate_stats(per_rank)
        args = self.server_args
        args = dataclasses.asdict(args) if dataclasses.is_dataclass(args) else dict(vars(args))
        return {
            **args,
            # the KV cache's size (memory_report.report_kv_capacity), over every DP rank
            **{k: stats[k] for k in KV_CAPACITY_STATS if k in stats},
            "served_model_name": self.served_model_name,
            "context_length": self.context_length,
            "vocab_size": self.vocab_size,
            "scheduler_pid": self.scheduler_pid,
            "scheduler_pids": self.client.controller.pids,
            "scheduler_stats": stats,
            "dp_rank_stats": per_rank,
            # requests the DP router sent to a rank for a prompt prefix it had sent there (cache_aware)
            "dp_cache_routed_reqs": self.client.controller.router.cache_routed,
        }
