"""The scheduler: which requests run in the next forward, and what the sampled tokens mean.

Pure policy over the runner's request->token pool; it never touches a GPU itself (tests feed
it a fake runner). One `step()` = pick a batch, one `model_runner.forward`, sample, finish.

Policy, in order of precedence:
- Decode rows first claim the pages their next token needs; when the pool cannot cover
  them, the newest requests holding KV (arrival order) are retracted: pages and slot freed,
  put back at the front of the waiting queue with their generated tokens kept, so they
  re-prefill prompt + output and continue exactly where they stopped. A lone request that
  still does not fit can never fit and fails with an error.
- Prefill admits waiting requests in queue order (no skipping; FCFS, or with
  --schedule-policy lpm longest cached prefix first) while the token budget
  (--chunked-prefill-size), free request slots, --max-running-requests and the KV budget
  allow. The KV budget is the free pages minus a reserve for the running requests' next
  decode token. A request that does not fit whole is prefilled up to the budget and becomes
  the one "chunked" request; it continues first in the next prefill.
- --enable-mixed-chunk: the prefill chunk and every decode row share one MIXED forward (the
  chunk's budget shrinks by the decode rows, so the step stays within the chunk size).
  Otherwise prefill and decode steps alternate when both have work, prefill first: pure
  prefill priority would stall every running request for the whole duration of a long queue.
- A step that had to retract does no prefill, so a request is never retracted and
  re-admitted in the same step.
- Prefix caching (managers/prefix_caching.py; on unless --disable-radix-cache): an admitted
  request starts after the longest cached prefix it can resume from; cached pages nobody
  uses count as available and are evicted (least recently used first) before anything is
  retracted or refused.

Overlap scheduling (default; --disable-overlap-schedule turns it off): `step()` launches
forward N+1 before it processes forward N's sampled tokens, so the host schedules, builds
metadata and enqueues uploads while the GPU runs. Sampled ids stay on the device
(managers/overlap.py); the host sees them one step late, so finish checks and outputs lag
one step. Without overlap the same code runs with the step processed right after its launch.
The contract (docs/overlap.md):
- A request whose length limit (max_new_tokens, context) is reached by its in-flight tokens
  is not scheduled again: that finish is known without the ids. A stop (token or string)
  is seen one step late, so the request may already be in the next forward: that extra
  token is dropped (never reported, counted in num_dropped_tokens).
- KV is freed right after a later step was launched (finish at processing, abort between
  steps): every forward that writes it is already enqueued, and any reuse of its pages or
  slot (page-table writes, the next forward) is enqueued after it on the same stream.
- Retraction and the unfittable-request failure need the host to know every output token:
  when the decode rows do not fit, the in-flight step is processed first (a forced resolve).
"""

from __future__ import annotations

import collections
import logging
from typing import Callable, Deque, Dict, List, Optional, Tuple

from sglang.srt.layers.logprobs import token_logprobs
from sglang.srt.layers.sampler import Sampler
from sglang.srt.managers.scripted_outputs import ScriptedOutputs
from sglang.srt.managers.io_struct import GenerateReqInput, TokenOut
from sglang.srt.managers.overlap import FutureMap, LaunchedStep, rows_to_device
from sglang.srt.managers.prefix_caching import make_prefix_caching
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch, check_finished, eos_ids_of
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.speculative import make_speculator

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, server_args, model_runner, decode_fn: Optional[Callable[[List[int]], str]] = None):
        if not getattr(server_args, "resolved", False):
            raise ValueError("Scheduler needs resolved ServerArgs: call server_args.resolve(...) first")
        self.server_args = server_args
        self.model_runner = model_runner
        self.decode_fn = decode_fn
        self.pool = model_runner.req_to_token_pool
        self.page_size = self.pool.page_size
        self.device = model_runner.device
        self.context_length = min(server_args.context_length, self.pool.max_context_len)
        self.max_running_requests = min(server_args.max_running_requests, self.pool.max_num_reqs)
        size = server_args.chunked_prefill_size
        self.chunked_prefill_size: Optional[int] = size if size and size > 0 else None
        # the raw-KV staging rows hold one step (the pool is built with this bound): no step
        # may carry more tokens
        self.max_step_tokens = server_args.max_step_tokens
        self.enable_mixed_chunk = server_args.enable_mixed_chunk
        self.stream_interval = server_args.stream_interval
        self.vocab_size = model_runner.config.vocab_size
        self.eos_token_ids = eos_ids_of(model_runner.config)
        self.sampler = Sampler(seed=server_args.random_seed)
        self.scripted = ScriptedOutputs.from_env(min(self.eos_token_ids, default=0))
        self.overlap = not getattr(server_args, "disable_overlap_schedule", False)
        self.future_map = FutureMap(self.pool.slots.capacity, self.device)
        self._inflight: Optional[LaunchedStep] = None  # launched, sampled ids not read yet
        self.prefix_caching = make_prefix_caching(server_args, model_runner)  # None when off
        self.speculator = make_speculator(server_args, model_runner)  # None when off
        if self.speculator is not None and self.scripted is not None:
            raise ValueError("scripted test outputs do not combine with speculative decoding")

        self.waiting: Deque[Req] = collections.deque()
        self.running: List[Req] = []  # prefilled requests, decoding
        self.chunked_req: Optional[Req] = None  # partly prefilled, holds KV
        self._live: Dict[str, Req] = {}  # every unfinished request by rid
        self._pending_outs: List[TokenOut] = []  # aborts/failures reported by the next step()
        self._next_arrival = 0
        self._last_was_prefill = False
        self.last_batch_mode: Optional[ForwardMode] = None
        self.last_batch: Optional[ScheduleBatch] = None  # the batch the last step() launched
        self.num_forwards = {m: 0 for m in (ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.MIXED, ForwardMode.IDLE)}
        self.counters = collections.Counter()

    # ---- requests in and out -----------------------------------------------------------

    def add_request(self, req_in: GenerateReqInput) -> None:
        """Queue a request; ValueError (and no state kept) when it can never be served."""
        if req_in.rid in self._live:
            raise ValueError(f"a request with rid {req_in.rid!r} is already running")
        req = Req.from_input(req_in, self.vocab_size, self.context_length, self.pool.pages.capacity * self.page_size,
                             has_tokenizer=self.decode_fn is not None, arrival_seq=self._next_arrival)
        self._next_arrival += 1
        self._live[req.rid] = req
        self.waiting.append(req)

    def abort_request(self, rid: str) -> bool:
        """Drop a request wherever it is, freeing its KV at once; its final TokenOut (finish
        reason "abort") comes with the next step(). False when the rid is not live."""
        req = self._live.get(rid)
        if req is None:
            return False
        # Safe while a launched step still writes its KV: aborts arrive between steps, so that
        # step is already enqueued, and whatever reuses the pages is enqueued after it on the
        # same stream. Its in-flight token is dropped when that step is processed.
        self._finish(req, {"type": "abort", "message": "aborted by the client"}, count="aborted")
        self._pending_outs.append(req.token_out())
        return True

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked_req or self._pending_outs
                    or self._inflight is not None)

    # ---- one step --------------------------------------------------------------------

    def step(self, dp_sync=None) -> List[TokenOut]:
        """Launch at most one forward, then process the previous one (overlap) or this one;
        return the TokenOuts that processing (and any abort since) produced.

        Under DP attention (`dp_sync` given) every rank calls this every iteration, with or
        without local work: the step's path is agreed first and idle ranks still join.
        """
        batch = self._next_batch()  # may force a resolve of the in-flight step (retraction)
        outs, self._pending_outs = self._pending_outs, []
        self.last_batch_mode = batch.forward_mode if batch else None
        self.last_batch = batch
        launched = self._launch(batch, dp_sync)
        previous, self._inflight = self._inflight, launched
        if previous is not None:
            if launched is not None:
                self.counters["overlap_steps"] += 1  # this launch went out before the host waited
            outs += self._process(previous)
        if not self.overlap and self._inflight is not None:
            outs += self._resolve_inflight()
        return outs

    def _resolve_inflight(self) -> List[TokenOut]:
        launched, self._inflight = self._inflight, None
        return self._process(launched) if launched is not None else []

    def _launch(self, batch: Optional[ScheduleBatch], dp_sync) -> Optional[LaunchedStep]:
        """Build the forward batch (placeholders resolved on the device), run it and sample on
        the device; None when nothing was sampled for this rank (no batch, an idle DP step)."""
        if batch is None and dp_sync is None:
            return None
        if batch is not None:
            fb = batch.to_forward_batch(self.device)
            if batch.has_placeholders():
                fb.input_ids = self.future_map.resolve(fb.input_ids)
        else:
            from sglang.srt.model_executor.forward_batch_info import build_forward_batch

            fb = build_forward_batch(ForwardMode.IDLE, [], [], [], self.device)
        if self.speculator is not None:
            step = self.speculator.run(self, batch, fb, dp_sync)  # None: idle here, or nobody had work
            if batch is None:
                self.num_forwards[ForwardMode.IDLE] += step is not None
                return None
            self.num_forwards[batch.forward_mode] += 1
            self._last_was_prefill = batch.num_prefill_reqs == len(batch.reqs)
            return step
        if dp_sync is None:
            logits = self.model_runner.forward(fb).next_token_logits
        else:
            from sglang.srt.model_executor.dp_sync import dp_step

            _, out = dp_step(self.model_runner, fb, dp_sync)
            if out is None:  # no rank had work
                return None
            if batch is None:
                self.num_forwards[ForwardMode.IDLE] += 1
                return None
            logits = out.next_token_logits
        self.num_forwards[batch.forward_mode] += 1
        self._last_was_prefill = batch.forward_mode == ForwardMode.EXTEND
        return self._sample(batch, logits)

    def _next_batch(self) -> Optional[ScheduleBatch]:
        batch = self._schedule()
        if batch is None and not self.running and self.chunked_req is not None:
            # nothing else holds KV, yet the chunked request cannot continue: it never will
            self._fail_unfittable(self.chunked_req)
        return batch

    def _schedule(self) -> Optional[ScheduleBatch]:
        has_prefill = self.chunked_req is not None or bool(self.waiting)
        if self.enable_mixed_chunk:
            decode, retracted, drafts = self._prepare_decode() if self.running else ([], False, [])
            # the chunk shrinks by the decode rows so the step stays near the chunk size, but
            # keeps at least one token so a large running set never starves the queue
            chunk = self.chunked_prefill_size if self.chunked_prefill_size is not None else self.max_step_tokens
            budget = max(1, min(chunk, self.max_step_tokens) - len(decode) - sum(map(len, drafts)))
            prefill = [] if retracted or not has_prefill else self._plan_prefill(budget, decode_allocated=bool(decode))
            return ScheduleBatch.of(prefill, decode, drafts)
        if has_prefill and not (self.running and self._last_was_prefill):
            prefill = self._plan_prefill(self.chunked_prefill_size, decode_allocated=False)
            if prefill:
                return ScheduleBatch.of(prefill, [])
        if self.running:
            decode, _, drafts = self._prepare_decode()
            batch = ScheduleBatch.of([], decode, drafts)
            if batch is not None or not has_prefill:
                return batch
            # every running request is finishing on its in-flight tokens (overlap): prefill now
            return ScheduleBatch.of(self._plan_prefill(self.chunked_prefill_size, decode_allocated=False), [])
        return None

    # ---- KV budget -------------------------------------------------------------------

    def _pages_held(self, req: Req) -> int:
        return -(-req.prefix_len // self.page_size)  # the KV invariant (schedule_batch.py)

    @property
    def num_evictable_pages(self) -> int:
        """Pages only the prefix cache holds (no request maps them): the pool evicts them on
        demand. With no request holding KV, free + evictable pages are the whole pool."""
        return self.prefix_caching.evictable_pages if self.prefix_caching is not None else 0

    def _available_pages(self) -> int:
        """Free pages plus the cached ones nobody uses."""
        return self.pool.num_free_pages + self.num_evictable_pages

    def _holders(self) -> List[Req]:
        return self.running + ([self.chunked_req] if self.chunked_req is not None else [])

    def _num_drafts(self, req: Req, num_decode: int) -> int:
        """Drafts a decode row feeds: what the MTP layer proposed, within the step's token
        bound, the request's remaining tokens (one comes from the target anyway) and the
        context."""
        if self.speculator is None or not req.spec_drafts:
            return 0
        # a mixed step keeps at least one prefill token
        per_row = (self.max_step_tokens - int(self.enable_mixed_chunk)) // max(num_decode, 1) - 1
        n = min(len(req.spec_drafts), per_row, req.sampling_params.max_new_tokens - req.num_generated - 1,
                self.context_length - req.seq_len)
        if self.prefix_caching is not None:
            # never past the next page boundary: the accepted length then lands on it at some
            # step, where the prefix cache takes its state
            n = min(n, self.page_size - 1 - req.prefix_len % self.page_size)
        return max(0, n)

    def _prepare_decode(self) -> Tuple[List[Req], bool, List[List[int]]]:
        """Map the next position of every running request (and of its drafts), retracting the
        newest holders until that fits. Returns (decode rows, whether anything was
        retracted, each row's drafts)."""
        retracted = False
        while self.running:
            rows = self._decodable()
            need = sum(self.pool.pages_needed(r.req_pool_idx, r.seq_len + self._num_drafts(r, len(rows)))
                       for r in rows)
            if need <= self._available_pages():
                break
            if self._inflight is not None:
                # retraction re-prefills prompt + outputs, and a failure reports them: both
                # need every output on the host, and the finishes may free enough pages
                self.counters["forced_resolves"] += 1
                self._pending_outs += self._resolve_inflight()
                continue
            holders = self._holders()
            if len(holders) == 1:
                self._fail_unfittable(holders[0])
                continue
            self._retract(max(holders, key=lambda r: r.arrival_seq))
            retracted = True
        decode = self._decodable()
        drafts = []
        for r in decode:
            drafts.append(self.speculator.drafts_for(r, self._num_drafts(r, len(decode))) if self.speculator else [])
            self.pool.ensure_capacity(r.req_pool_idx, r.seq_len + len(drafts[-1]))
        return decode, retracted, drafts

    def _decodable(self) -> List[Req]:
        """Running requests that need another token: one whose in-flight tokens reach its
        length limit finishes when they are processed, whatever they are."""
        return [r for r in self.running if not (r.pending_ids and (
            r.num_generated >= r.sampling_params.max_new_tokens or r.seq_len >= self.context_length))]

    def _plan_prefill(self, token_budget: Optional[int], decode_allocated: bool) -> List[Tuple[Req, int]]:
        """Admit chunks in the queue's order (--schedule-policy: arrival, or longest cached
        prefix first) and allocate their slots and pages. Returns (req, num_tokens)."""
        # Keep pages for each running request's next decode token (one past the row this step
        # already mapped, when decode rows run in the same forward).
        extra = (1 if decode_allocated else 0) + (self.speculator.num_steps if self.speculator else 0)
        reserve = sum(self.pool.pages_needed(r.req_pool_idx, r.seq_len + extra) for r in self.running)
        # no chunking: whole prompts, as many as one step's staging rows hold
        tokens_left = self.max_step_tokens if token_budget is None else min(token_budget, self.max_step_tokens)
        num_holders = len(self._holders())
        plan: List[Tuple[Req, int]] = []
        cache = self.prefix_caching
        if self.server_args.schedule_policy == "lpm" and num_holders < self.max_running_requests:
            cache.order_longest_prefix_first(self.waiting)  # resolve() made sure the cache is on
        while tokens_left > 0:
            req = self.chunked_req if (self.chunked_req is not None and not plan) else (
                self.waiting[0] if self.waiting else None)
            if req is None:
                break
            is_new = req.req_pool_idx is None
            if is_new and (num_holders >= self.max_running_requests or self.pool.slots.num_free == 0):
                break
            # a cached prefix is locked before the budget is read: its pages stop being evictable
            match = cache.lookup(req) if is_new and cache is not None else None
            prefix = match.length if match is not None else req.prefix_len
            page_budget = self._available_pages() - reserve
            pending = req.seq_len - prefix
            # without chunking a prompt waits for a step it fits in whole
            if page_budget < 0 or (self.chunked_prefill_size is None and plan and pending > tokens_left):
                if match is not None:
                    cache.unlock(match)
                break
            # pages held once admitted: a match's shared ones (a tail's page is copied into a new one)
            held = prefix // self.page_size if match is not None else -(-prefix // self.page_size)
            fits = (held + page_budget) * self.page_size - prefix
            n = int(min(pending, tokens_left, fits))
            if n > 0 and cache is not None:
                n = cache.cut_chunk(req.seq_len, prefix, n)
            if n <= 0:
                if match is not None:
                    cache.unlock(match)
                break
            if is_new:
                self.waiting.popleft()
                req.req_pool_idx = self.pool.alloc_req()
                num_holders += 1
                if match is not None:
                    cache.admit(req, match)  # the lookup's lock becomes the request's
            self.pool.ensure_capacity(req.req_pool_idx, req.prefix_len + n)
            tokens_left -= n
            plan.append((req, n))
            # only one request is ever partly prefilled: it stops admission for this step
            if n < req.num_pending_tokens:
                self.chunked_req = req
                break
            if req is self.chunked_req:
                self.chunked_req = None
        return plan

    def _retract(self, req: Req) -> None:
        assert not req.pending_ids, "resolve the in-flight step before retracting (outputs re-prefill)"
        logger.info("retracting %s (%d tokens) to free KV pages", req.rid, req.seq_len)
        self._release_kv(req)
        req.spec_drafts, req.spec_draft_probs = [], None  # drafted for KV it no longer holds
        req.num_retractions += 1
        self.counters["retracted"] += 1
        self.waiting.appendleft(req)  # newest first, so the front ends up oldest-first

    def _fail_unfittable(self, req: Req) -> None:
        msg = (f"request {req.rid} needs {req.seq_len} tokens of KV cache, more than the whole pool "
               f"({self.pool.pages.capacity * self.page_size} tokens, --max-total-tokens)")
        logger.error(msg)
        req.error = msg
        self._finish(req, {"type": "abort", "message": msg}, count="failed")
        self._pending_outs.append(req.token_out())

    def _release_kv(self, req: Req) -> None:
        if req in self.running:
            self.running.remove(req)
        if req is self.chunked_req:
            self.chunked_req = None
        if self.prefix_caching is not None:
            self.prefix_caching.release(req)  # unlocks its cached prefix; the tree keeps its own holds
        if req.req_pool_idx is not None:
            self.pool.free_req(req.req_pool_idx)
            req.req_pool_idx = None
        req.prefix_len = 0

    def _finish(self, req: Req, reason: dict, count: str) -> None:
        req.finish_reason = reason
        req.pending_ids.clear()  # in-flight tokens after the finish: dropped when processed
        if count == "finished" and self.prefix_caching is not None and req.req_pool_idx is not None:
            self.prefix_caching.on_finish(req)
        was_waiting = req.req_pool_idx is None  # every request holding no slot is queued
        self._release_kv(req)
        if was_waiting:
            self.waiting.remove(req)
        self._live.pop(req.rid, None)
        self.counters[count] += 1

    # ---- results ---------------------------------------------------------------------

    def _sample(self, batch: ScheduleBatch, logits) -> LaunchedStep:
        """Advance the KV bookkeeping of a launched forward and sample its completing rows on
        the device; their tokens become placeholders until the step is processed."""
        rows = [i for i in range(len(batch.reqs)) if batch.completes(i)]
        for i, (req, n) in enumerate(zip(batch.reqs, batch.extend_lens)):
            req.prefix_len += n
            if self.prefix_caching is not None:
                self.prefix_caching.after_forward(req, prefill=i < batch.num_prefill_reqs)
        step = LaunchedStep()
        # max_new_tokens == 0 ends right after prefill: its logits are not sampled. Its KV is
        # freed after this forward was launched (stream order keeps that safe).
        for req in [batch.reqs[i] for i in rows if batch.reqs[i].sampling_params.max_new_tokens == 0]:
            self._finish(req, {"type": "length", "length": 0}, count="finished")
            step.early_outs.append(req.token_out())
        rows = [i for i in rows if batch.reqs[i].sampling_params.max_new_tokens > 0]
        if not rows:
            return step
        reqs = [batch.reqs[i] for i in rows]
        if len(rows) < logits.shape[0]:
            logits = logits[rows_to_device(rows, logits.device)]
        ids = self.sampler(logits, [r.sampling_params for r in reqs], [r.generator for r in reqs])
        if self.scripted is not None:
            ids = self.scripted.apply(reqs, ids)
        first = self.future_map.store(ids)
        step.logprob_rows = [j for j, r in enumerate(reqs) if r.return_logprob]
        logprobs = ()
        if step.logprob_rows:
            rows_lp = step.logprob_rows
            sel = rows_to_device(rows_lp, logits.device) if len(rows_lp) < len(reqs) else None
            logprobs = token_logprobs(logits if sel is None else logits[sel], ids if sel is None else ids[sel],
                                      max(reqs[j].top_logprobs_num for j in rows_lp))
        (step.host_ids, *step.host_logprobs), step.event = LaunchedStep.copy_to_host(ids, *logprobs)
        for j, (i, req) in enumerate(zip(rows, reqs)):
            req.pending_ids.append(-(first + j))
            step.reqs.append(req)
            step.placeholders.append(-(first + j))
            if i < batch.num_prefill_reqs:
                self.running.append(req)  # its prefill just completed: it decodes from now on
        return step

    def _process(self, step: LaunchedStep) -> List[TokenOut]:
        """Read a launched step's sampled ids (waits for that step only) and apply them:
        append, finish checks, stream outputs. A request that finished meanwhile (a stop seen
        one step late, an abort) drops its token."""
        outs = list(step.early_outs)
        tokens = step.wait_tokens()
        logprobs = step.logprobs_by_position()
        for pos, (req, placeholder, tok) in enumerate(zip(step.reqs, step.placeholders, tokens)):
            if req.finished:
                self.counters["dropped_tokens"] += 1
                continue
            assert req.pending_ids and req.pending_ids[0] == placeholder, "in-flight tokens resolve in order"
            req.pending_ids.pop(0)
            req.output_ids.append(tok)
            if pos in logprobs:
                req.output_logprobs.append(logprobs[pos][0])
                req.output_top_logprobs.append(logprobs[pos][1])
            self.counters["generated_tokens"] += 1
            reason = check_finished(req, self.eos_token_ids, self.context_length, self.decode_fn)
            if reason is not None:
                self._finish(req, reason, count="finished")
            unsent = len(req.output_ids) - req.num_sent
            if req.finished or (req.stream and (req.num_sent == 0 or unsent >= self.stream_interval)):
                outs.append(req.token_out())
        return outs

    # ---- introspection ---------------------------------------------------------------

    def get_stats(self) -> dict:
        runner_stats = self.model_runner.get_stats() if hasattr(self.model_runner, "get_stats") else {}
        forwards = {m.name.lower(): n for m, n in self.num_forwards.items()}
        return {
            **runner_stats,
            "num_waiting_reqs": len(self.waiting),
            "num_running_reqs": len(self._holders()),
            "num_chunked_reqs": int(self.chunked_req is not None),
            "num_free_pages": self.pool.num_free_pages,
            "num_evictable_pages": self.num_evictable_pages,  # free on demand: see num_evictable_pages
            "num_total_pages": self.pool.pages.capacity,
            "page_size": self.page_size,
            "num_free_req_slots": self.pool.slots.num_free,
            "num_total_req_slots": self.pool.slots.capacity,
            "max_running_requests": self.max_running_requests,
            "num_forwards": sum(forwards.values()),
            **{f"num_forwards_{name}": n for name, n in forwards.items()},
            "num_retracted_reqs": self.counters["retracted"],
            "num_finished_reqs": self.counters["finished"],
            "num_aborted_reqs": self.counters["aborted"],
            "num_failed_reqs": self.counters["failed"],
            "num_generated_tokens": self.counters["generated_tokens"],
            "overlap_schedule": self.overlap,
            "num_overlap_steps": self.counters["overlap_steps"],
            "num_dropped_tokens": self.counters["dropped_tokens"],
            "num_forced_resolves": self.counters["forced_resolves"],
            "prefix_caching": self.prefix_caching is not None,
            **(self.prefix_caching.get_stats() if self.prefix_caching is not None else {}),
            **(self.speculator.get_stats() if self.speculator is not None else {}),
        }
