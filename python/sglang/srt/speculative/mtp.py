"""MTP speculative decoding: the model's own MTP layer drafts, one target step verifies.

One speculative step over a batch (prefill chunks and decode rows, the scheduler's batch):
1. Each decode row feeds its last token and the k drafts the MTP layer proposed for it: an
   extend row of k + 1 tokens (graphs replay it like any extend). Before the forward, the
   ring rows the drafts' positions overwrite are copied (ring_snapshot.py).
2. The target's logits at every row of a decode request decide how many drafts it keeps:
   greedy rows keep the longest prefix equal to the target's argmax, sampled rows accept
   draft i with probability min(1, p(d) / q(d)) and resample a rejection from
   max(0, p - q) (Leviathan et al.), so outputs follow the target's distribution; every
   row gains one token from the target (the correction or the bonus). Rejected positions'
   ring rows are written back; their pages beyond the accepted length are returned.
3. The MTP layer then runs over every position whose target residual streams this step
   computed and whose next token is now known (prefill positions with the prompt's next
   token or the sampled one; decode rows' accepted positions). Position p reads the target
   streams at p and the token at p + 1; its output at each request's last position drafts
   the first token of the next step.
4. Draft steps 2..k feed the MTP layer its own output streams and the previous draft, one
   position further each time. Those positions are tentative in the MTP layer's rings too:
   they are written back once the drafts are taken (step 3 of the next step writes them
   for real).

Checkpoints with several MTP modules chain them: draft step s (1-based) runs module
min(s, modules) - 1, so the last one repeats itself when k exceeds the modules (the runner
builds only the first min(modules, k): ServerArgs.run_config). Module j >= 1 at position p
reads module j - 1's output at p - 1 and the token at p + 1, which is DeepSeek's training
layout (depth j + 1 at index i sees depth j's state at i and token i + j + 1) with module j's
positions shifted by j. In step 3 every module runs over the committed positions, so each
keeps exact history in its own caches: module j's input at a request's first committed
position of the step is module j - 1's output one position back, carried from the previous
step in the KV pool's slot row (DSV4KVPool.mtp_carry; zeros before position 0; part of a
prefix-cache resume state).

The host needs the accepted lengths before it can build the next batch, so speculative
steps run without overlap scheduling. It does not wait for the drafts, though: they stay on
the device (a row per request slot, `draft_ids`), the next verify batch is built with
placeholders that `run` replaces there before the forward, and their values reach the host by
a non-blocking copy, read only when the verify judges them (`DeviceDrafts`). So the host
reports the step's tokens and builds the next batch while the device still runs the draft
steps.
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Sequence
from typing import Callable, List, Optional

import torch

from sglang.srt.layers.logprobs import token_logprobs
from sglang.srt.layers.sampler import sample_from_probs, sampling_probs
from sglang.srt.managers.overlap import LaunchedStep
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.model_executor.forward_batch_info import ForwardMode, build_forward_batch
from sglang.srt.model_executor.graph_dispatch import StepInfo
from sglang.srt.model_executor.mtp_graph_runner import draft_step_module
from sglang.srt.speculative.ring_snapshot import RingSnapshot

logger = logging.getLogger(__name__)

# (request, position of its first draft, drafts the MTP layer proposed) -> the drafts to verify.
# Test-only: drives acceptance (all, none, a chosen prefix) on random-weight models.
DraftOverride = Callable[[Req, int, List[int]], List[int]]

# Benchmarks only: with random weights the drafts are almost never accepted, so throughput
# runs pin a mean accepted length instead (as published DSV4 speculative benchmarks do): each
# greedy row keeps floor(x + u) of its drafts, u uniform, whatever the target says. Drafting
# and verification cost what they really cost; the tokens are not the model's.
SIMULATE_ENV = "SGLANG_SIMULATE_ACCEPT_LENGTH"


class DeviceDrafts(Sequence):
    """A request's drafts (`Req.spec_drafts`) from one draft step: row `row` of that step's
    [n, k] draft ids, copied to the host without blocking; the values are read (waiting for
    the copy once) only when something on the host needs them, the verify's acceptance after
    the device has long finished them."""

    def __init__(self, host: "_HostDrafts", row: int):
        self._host, self._row = host, row

    def __len__(self) -> int:
        return self._host.width

    def __getitem__(self, i):
        return self._host.rows()[self._row][i]


class _HostDrafts:
    """One draft step's ids on their way to the host: a pinned copy and its event on CUDA."""

    def __init__(self, ids: torch.Tensor):
        self.width = ids.shape[1]
        (self._host,), self._event = LaunchedStep.copy_to_host(ids)
        self._rows: Optional[List[List[int]]] = None

    def rows(self) -> List[List[int]]:
        if self._rows is None:
            if self._event is not None:
                self._event.synchronize()
            self._rows = self._host.tolist()
        return self._rows


class MTPSpeculator:
    def __init__(self, model_runner, num_steps: int):
        self.runner = model_runner
        self.num_steps = num_steps
        cfg = model_runner.config
        self.target_layers = list(range(cfg.num_hidden_layers))
        self.mtp_layers = list(range(cfg.num_hidden_layers, cfg.num_hidden_layers + model_runner.num_mtp_layers))
        if len(self.mtp_layers) == 0:
            raise ValueError("speculative decoding needs a model runner built with its MTP layers")
        if len(self.mtp_layers) > 1:
            logger.info("%d chained MTP modules draft %d tokens a step (module min(s, %d) - 1 drafts token s)",
                        len(self.mtp_layers), num_steps, len(self.mtp_layers))
        self.draft_override: Optional[DraftOverride] = None
        simulate = os.environ.get(SIMULATE_ENV)
        self.simulate_accept_length = float(simulate) if simulate else None
        if self.simulate_accept_length is not None:
            if not 0 <= self.simulate_accept_length <= num_steps:
                raise ValueError(f"{SIMULATE_ENV}={simulate}: must be in [0, {num_steps}] (--speculative-num-steps)")
            logger.warning("%s=%s: drafts are accepted by a simulated rule, not by the model (benchmarks only)",
                           SIMULATE_ENV, simulate)
            self._rng = random.Random(0)
        self.stats = {"spec_verify_rows": 0, "spec_draft_tokens": 0, "spec_accepted_tokens": 0}
        # each request slot's latest drafts on the device (+ the padding slot), what its verify row feeds
        self.draft_ids = torch.zeros(model_runner.req_to_token_pool.padding_slot + 1, num_steps, dtype=torch.int64,
                                     device=model_runner.device)

    # ---- what the scheduler asks ---------------------------------------------------------

    def drafts_for(self, req: Req, max_drafts: int) -> List[int]:
        """The drafts a decode row feeds this step (at most max_drafts; none before the MTP
        layer has drafted for it): placeholders that `run` replaces on the device with the
        MTP layer's drafts, or with a draft_override the override's tokens (read on the host)."""
        n = min(len(req.spec_drafts), max(0, max_drafts))
        if n == 0:
            return []
        if self.draft_override is not None:
            return list(self.draft_override(req, req.seq_len, list(req.spec_drafts)[:n]))[:n]
        return [0] * n

    def get_stats(self) -> dict:
        rows, drafted, accepted = (self.stats[k] for k in ("spec_verify_rows", "spec_draft_tokens",
                                                           "spec_accepted_tokens"))
        return dict(self.stats, spec_accept_rate=accepted / drafted if drafted else 0.0,
                    spec_mean_accepted_per_row=accepted / rows if rows else 0.0)

    # ---- one step --------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, sched, batch: Optional[ScheduleBatch], fb, dp_sync=None) -> Optional[LaunchedStep]:
        """Forward, verify, advance the requests' KV bookkeeping and draft for the next step.
        Returns the step with every output token already known (host ids).

        Under DP attention (dp_sync) every rank calls this every step, an idle one with no
        batch and an empty `fb`: the ranks agree the target's path, and then run the same
        sequence of MTP forwards (the extend, then k - 1 draft steps; empty where a rank has
        nothing to draft), whose MoE is collective. Returns None on an idle rank, or when no
        rank had work."""
        runner, pool = self.runner, sched.pool
        self.mtp_paths, path = (None, None), None
        if dp_sync is not None:
            from sglang.srt.model_executor.dp_sync import agree_path
            from sglang.srt.model_executor.forward_batch_info import DPInfo

            path = agree_path(fb, dp_sync)
            if path is None:
                return None
            fb.dp = DPInfo(global_num_tokens_cpu=list(path.global_num_tokens), dp_rank=dp_sync.dp_rank)
            # Every rank runs the MTP forwards of this step on the same paths, from what all
            # ranks agreed: the pass over committed positions carries at most the largest
            # rank's tokens, a draft step at most the largest rank's requests.
            tokens = max(max(path.global_num_tokens), 1)
            reqs = max([i.batch_size for i in dp_sync.infos if not i.idle] + [1])
            self.mtp_paths = (runner.mtp_path(StepInfo(tokens, int(ForwardMode.EXTEND), 1)),
                              runner.mtp_path(StepInfo(reqs, int(ForwardMode.DECODE), reqs)))
            if batch is None:
                runner.forward_hidden(fb, path)
                self._idle_mtp_forwards(sched)
                return LaunchedStep()
        n_pre = batch.num_prefill_reqs
        drafts = batch.drafts or [[] for _ in batch.reqs[n_pre:]]
        starts = [0]  # each row's first token in the batch
        for n in batch.extend_lens:
            starts.append(starts[-1] + n)
        if self.draft_override is None and any(drafts):
            self._feed_drafts(batch, fb, drafts, starts, sched.device)
        spans = [(r.req_pool_idx, r.prefix_len + 1, len(d)) for r, d in zip(batch.reqs[n_pre:], drafts) if d]
        snapshot = RingSnapshot(runner.kv_pool, self.target_layers, spans) if spans else None
        hidden = runner.forward_hidden(fb, path)
        T = fb.num_live_tokens
        # read before the next target forward rewrites it (the MTP forwards leave it alone)
        streams = runner.model.streams_out[:T]
        if self.draft_override is None:  # the values fed, for the acceptance (copied long ago)
            drafts = [list(r.spec_drafts)[:len(d)] if d else d for r, d in zip(batch.reqs[n_pre:], drafts)]

        # rows whose logits are read: each completing prefill chunk's last, every decode row's
        finished_at_prefill = []
        sample_rows, owners = [], []  # logits rows, and (request index, offset within its verify row)
        for i, req in enumerate(batch.reqs):
            if i < n_pre:
                if batch.completes(i):
                    if req.sampling_params.max_new_tokens == 0:
                        finished_at_prefill.append(req)
                    else:
                        sample_rows.append(starts[i + 1] - 1)
                        owners.append((i, 0))
            else:
                for m in range(batch.extend_lens[i]):
                    sample_rows.append(starts[i] + m)
                    owners.append((i, m))
        logits = runner.model.compute_logits(hidden[torch.tensor(sample_rows, dtype=torch.int64).to(hidden.device)]) \
            if sample_rows else None
        row_of = {o: j for j, o in enumerate(owners)}

        out_tokens = self._accept(sched, batch, drafts, logits, row_of)  # {request index: [tokens]}

        if snapshot is not None:  # rejected positions: their ring rows as before the step
            snapshot.restore([(r.req_pool_idx, r.prefix_len + 1 + len(out_tokens[n_pre + j]) - 1,
                               len(d) - (len(out_tokens[n_pre + j]) - 1))
                              for j, (r, d) in enumerate(zip(batch.reqs[n_pre:], drafts)) if d])

        # ---- the step's outputs, as the scheduler's LaunchedStep ----
        step = LaunchedStep()
        for req in finished_at_prefill:
            sched._finish(req, {"type": "length", "length": 0}, count="finished")
            step.early_outs.append(req.token_out())
        mtp_rows = []  # (request index, first position, next ids, stream rows) for the MTP extend
        flat_ids, flat_logit_rows = [], []
        for i, req in enumerate(batch.reqs):
            n = batch.extend_lens[i]
            if i < n_pre:
                toks = out_tokens.get(i, [])
                if batch.completes(i) and not toks:
                    continue  # finished at prefill (max_new_tokens 0): released above
                # the token after each position: the prompt's, and after a completed prompt the sampled one
                end = req.prefix_len + n
                nxt = req.token_slice(req.prefix_len + 1, end) + toks[:1] if toks else \
                    req.token_slice(req.prefix_len + 1, end + 1)
                mtp_rows.append((i, req.prefix_len, nxt, list(range(starts[i], starts[i] + n))))
                req.prefix_len += n
            else:
                toks = out_tokens[i]
                L = req.prefix_len
                mtp_rows.append((i, L, toks, list(range(starts[i], starts[i] + len(toks)))))
                req.prefix_len = L + len(toks)
                pool.truncate(req.req_pool_idx, req.prefix_len)  # pages only rejected positions used
            for m, tok in enumerate(toks):
                flat_ids.append(tok)
                flat_logit_rows.append(row_of[(i, m)])
                req.pending_ids.append(-(len(flat_ids)))
                step.reqs.append(req)
                step.placeholders.append(-(len(flat_ids)))
            if i < n_pre and toks:
                sched.running.append(req)  # its prefill just completed: it decodes from now on

        if flat_ids:
            ids = torch.tensor(flat_ids, dtype=torch.int64)
            step.host_ids = ids
            reqs = step.reqs
            step.logprob_rows = [j for j, r in enumerate(reqs) if r.return_logprob]
            if step.logprob_rows:
                rows = torch.tensor([flat_logit_rows[j] for j in step.logprob_rows], dtype=torch.int64)
                lp = token_logprobs(logits[rows.to(logits.device)], ids[step.logprob_rows].to(logits.device),
                                   max(reqs[j].top_logprobs_num for j in step.logprob_rows))
                step.host_logprobs = tuple(t.cpu() if t is not None else None for t in lp)

        self._draft(sched, batch, streams, mtp_rows)
        if sched.prefix_caching is not None:
            # states are taken once the MTP layer's rows of the same positions are written
            # (a resume restores its window ring too), and after the rollback
            for i, req in enumerate(batch.reqs):
                if req.req_pool_idx is not None:
                    sched.prefix_caching.after_forward(req, prefill=i < n_pre)
        return step

    def _feed_drafts(self, batch, fb, drafts, starts, dev) -> None:
        """Write each decode row's drafts into the batch's input ids on the device, from its
        slot's row of `draft_ids` (the host built the row with placeholders)."""
        n_pre, k = batch.num_prefill_reqs, self.num_steps
        pos, src = [], []
        for i, (r, d) in enumerate(zip(batch.reqs[n_pre:], drafts)):
            first = starts[n_pre + i] + 1  # after the row's last accepted token
            pos += range(first, first + len(d))
            src += range(r.req_pool_idx * k, r.req_pool_idx * k + len(d))
        pos, src = (torch.tensor(x, dtype=torch.int64).to(dev) for x in (pos, src))
        fb.input_ids[pos] = self.draft_ids.view(-1)[src]

    # ---- verification ------------------------------------------------------------------

    def _accept(self, sched, batch, drafts, logits, row_of) -> dict:
        """{request index: its output tokens this step} for every row that samples: accepted
        drafts, then the target's own token."""
        n_pre = batch.num_prefill_reqs
        out = {}
        if logits is None:
            return out
        argmax = logits.argmax(dim=-1).tolist()
        for i, req in enumerate(batch.reqs):
            if (i, 0) not in row_of:
                continue
            d = drafts[i - n_pre] if i >= n_pre else []
            params = req.sampling_params
            if params.is_greedy:
                j = 0
                while j < len(d) and d[j] == argmax[row_of[(i, j)]]:
                    j += 1
                if self.simulate_accept_length is not None:
                    j = min(len(d), int(self.simulate_accept_length + self._rng.random()))
                out[i] = d[:j] + [argmax[row_of[(i, j)]]]
            else:
                out[i] = self._accept_sampled(sched, req, d, logits, [row_of[(i, m)] for m in range(len(d) + 1)])
            if i >= n_pre:
                self.stats["spec_verify_rows"] += 1
                self.stats["spec_draft_tokens"] += len(d)
                self.stats["spec_accepted_tokens"] += len(out[i]) - 1
        return out

    def _uniform(self, sched, req) -> torch.Tensor:
        return torch.rand(1, generator=req.generator if req.generator is not None else sched.sampler.generator)

    def _accept_sampled(self, sched, req, d, logits, rows) -> List[int]:
        params = req.sampling_params
        rows_t = torch.tensor(rows, dtype=torch.int64).to(logits.device)
        p = sampling_probs(logits[rows_t], [params] * len(rows))
        q = req.spec_draft_probs
        for m, tok in enumerate(d):
            ratio = (p[m, tok] / q[m, tok]).item() if q[m, tok] > 0 else 0.0
            if self._uniform(sched, req).item() < min(1.0, ratio):
                continue
            residual = (p[m] - q[m]).clamp_(min=0)
            if residual.sum() <= 0:  # p == q: any rejection is a draw from p itself
                residual = p[m]
            tok_new = sample_from_probs((residual / residual.sum())[None], self._uniform(sched, req)).item()
            return d[:m] + [tok_new]
        bonus = sched.sampler(logits[rows_t[len(d):len(d) + 1]], [params], [req.generator]).item()
        return list(d) + [bonus]

    # ---- drafting -------------------------------------------------------------------------

    def _draft(self, sched, batch, streams: torch.Tensor, mtp_rows) -> None:
        """Run the MTP modules over this step's committed positions, then draft k tokens for
        every request that decodes next."""
        if not mtp_rows:
            if self.mtp_paths[0] is not None:
                self._idle_mtp_forwards(sched)
            return
        runner, k = self.runner, self.num_steps
        dev = sched.device
        reqs = [batch.reqs[i] for i, *_ in mtp_rows]
        rows = torch.tensor([j for *_, js in mtp_rows for j in js], dtype=torch.int64).to(dev)
        out_streams, final, fb = self._committed_passes(reqs, mtp_rows, streams[rows], dev)
        last = fb.last_token_indices()
        # who drafts: requests that decode next step (a finished or mid-prompt one does not)
        running = {id(r) for r in sched.running}  # a set: a list lookup per request is quadratic at large batches
        drafting = [j for j, r in enumerate(reqs) if id(r) in running and not r.finished]
        for r in reqs:
            r.spec_drafts, r.spec_draft_probs = [], None
        if not drafting:
            if self.mtp_paths[0] is not None:
                self._idle_mtp_forwards(sched, extend=False)
            return
        sel = torch.tensor(drafting, dtype=torch.int64).to(dev)
        cur_streams = out_streams[last[sel]]
        cur_logits = runner.model.compute_logits(final[last[sel]])
        dreqs = [reqs[j] for j in drafting]
        # the MTP layers' tentative positions: seq_len - 1 (this step's last token, now
        # prefix_len) and on, one per further draft
        spans = [(r.req_pool_idx, r.prefix_len, k - 1) for r in dreqs] if k > 1 else []
        snapshot = RingSnapshot(runner.kv_pool, self.mtp_layers, spans) if spans else None
        probs = [[] for _ in dreqs]
        # the drafts stay on the device until the last step, so the host builds each next
        # batch while the device still computes the previous draft
        drafts = []
        for step in range(k):
            toks = self._draft_tokens(sched, dreqs, cur_logits, probs)
            drafts.append(toks)
            if step == k - 1:
                break
            # ids as placeholders, then the device tensor: no host round trip
            fb = build_forward_batch(ForwardMode.DECODE, [r.req_pool_idx for r in dreqs],
                                     [r.prefix_len + step for r in dreqs], [[0] for _ in dreqs], dev)
            fb.input_ids = toks
            module = draft_step_module(step + 1, len(self.mtp_layers))
            cur_streams, final = runner.forward_mtp(fb, cur_streams, k=module, path=self.mtp_paths[1])
            # a graph's outputs are its bucket's rows, and its next replay rewrites them
            n = len(dreqs)
            cur_streams, cur_logits = cur_streams[:n].clone(), runner.model.compute_logits(final[:n])
        if snapshot is not None:
            snapshot.restore(spans)
        ids = torch.stack(drafts, dim=1)  # [n, k], left on the device: the next verify feeds it from there
        self.draft_ids[torch.tensor([r.req_pool_idx for r in dreqs], dtype=torch.int64).to(dev)] = ids
        host = _HostDrafts(ids)
        for j, r in enumerate(dreqs):
            r.spec_drafts = DeviceDrafts(host, j)
        for r, pr in zip(dreqs, probs):
            if pr:
                r.spec_draft_probs = torch.stack(pr)

    def _committed_passes(self, reqs, mtp_rows, streams: torch.Tensor, dev) -> tuple:
        """Every module over the step's committed positions (mtp_rows: request index, first
        position, next ids, rows): module 0 on the target's streams, module j on module
        j - 1's output one position back (the slot's carried row at a request's first
        position). Returns module 0's output streams, final hidden and batch."""
        slots = [r.req_pool_idx for r in reqs]
        starts = [L for _, L, _, _ in mtp_rows]
        next_ids = [nxt for _, _, nxt, _ in mtp_rows]
        batch = lambda: build_forward_batch(ForwardMode.EXTEND, slots, starts, next_ids, dev)  # noqa: E731
        fb = batch()
        out, final = self.runner.forward_mtp(fb, streams, k=0, path=self.mtp_paths[0])
        carry = self.runner.kv_pool.mtp_carry
        if carry is None:
            return out, final, fb
        # built on the host: row m of a request reads row m - 1 of the previous module's
        # output, its first row the slot's carried one (appended after the T rows)
        lens = [len(js) for *_, js in mtp_rows]
        T, src, a = sum(lens), [], 0
        for i, n in enumerate(lens):
            src += [T + i] + list(range(a, a + n - 1))
            a += n
        src, ends = torch.tensor(src, dtype=torch.int64).to(dev), fb.last_token_indices()
        slots_t = torch.tensor(slots, dtype=torch.int64).to(dev)
        fresh = torch.tensor([L == 0 for L in starts]).to(dev)[:, None, None]  # no position before 0
        prev_out = out
        for j in range(1, len(self.mtp_layers)):
            carried = carry[slots_t, j - 1].masked_fill(fresh, 0)
            inp = torch.cat([prev_out[:T], carried])[src]
            carry[slots_t, j - 1] = prev_out[ends]  # after the gather above read the old rows
            prev_out, _ = self.runner.forward_mtp(batch(), inp, k=j, path=self.mtp_paths[0])
        return out, final, fb

    def _idle_mtp_forwards(self, sched, extend: bool = True) -> None:
        """Under DP attention, the MTP forwards of a step this rank has nothing for: empty
        batches that still join the MoE collectives of the ranks that draft, module by module
        as they run them."""
        runner, cfg = self.runner, self.runner.config
        empty = torch.empty(0, cfg.hc_mult, cfg.hidden_size, dtype=runner.dtype, device=sched.device)
        passes = [(j, self.mtp_paths[0]) for j in range(len(self.mtp_layers))] if extend else []
        passes += [(draft_step_module(s, len(self.mtp_layers)), self.mtp_paths[1])
                   for s in range(1, self.num_steps)]
        for module, path in passes:
            fb = build_forward_batch(ForwardMode.IDLE, [], [], [], sched.device)
            runner.forward_mtp(fb, empty, k=module, path=path)

    def _draft_tokens(self, sched, reqs, logits, probs) -> torch.Tensor:
        """Each row's draft, int64 [n] on the device: the argmax for greedy rows, a draw from
        the filtered distribution for sampled ones (which probs keeps for the acceptance)."""
        toks = logits.argmax(dim=-1)
        for j, r in enumerate(reqs):
            if not r.sampling_params.is_greedy:
                q = sampling_probs(logits[j:j + 1], [r.sampling_params])[0]
                probs[j].append(q)
                toks[j:j + 1] = sample_from_probs(q[None], self._uniform(sched, r))
        return toks
