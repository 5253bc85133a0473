"""A request's scheduling state (`Req`) and the batch the scheduler builds for one forward.

KV invariant the scheduler keeps: a request holding a slot has positions [0, prefix_len) in
the KV cache and owns exactly ceil(prefix_len / page_size) pages between steps. The tokens
still to be fed are `token_ids[prefix_len:]`: part of the prompt while prefilling, the last
sampled token while decoding (one token), everything after a retraction.

Overlap scheduling: a token sampled by a step the host has not processed yet is a negative
placeholder in `pending_ids` (see managers/overlap.py); it counts in `seq_len` (its KV
position is scheduled) and is fed as the placeholder, which the device resolves. Finish
checks and outputs only ever read `output_ids`, the tokens the host knows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import torch

from sglang.srt.layers.sampler import make_generator
from sglang.srt.managers.io_struct import GenerateReqInput, TokenOut, check_logprob_args, check_prompt_ids
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode, build_forward_batch
from sglang.srt.sampling.sampling_params import SamplingParams


@dataclass(eq=False)  # identity semantics: requests are found in queues by `is`
class Req:
    rid: str
    origin_input_ids: List[int]
    sampling_params: SamplingParams
    stream: bool = False
    arrival_seq: int = 0  # set by the scheduler: FCFS order; the largest is the newest
    generator: Optional[torch.Generator] = None  # set by the scheduler when params.seed is given

    output_ids: List[int] = field(default_factory=list)  # sampled tokens the host knows
    pending_ids: List[int] = field(default_factory=list)  # placeholders of in-flight tokens (at most 2)
    req_pool_idx: Optional[int] = None  # request slot while it holds KV; None while waiting
    prefix_len: int = 0  # tokens already in the KV cache
    finish_reason: Optional[dict] = None
    error: Optional[str] = None
    num_sent: int = 0  # output tokens already reported in a TokenOut
    num_retractions: int = 0
    return_logprob: bool = False
    top_logprobs_num: int = 0
    output_logprobs: List[float] = field(default_factory=list)  # with return_logprob, per output id
    output_top_logprobs: List[list] = field(default_factory=list)  # (logprob, id) pairs per output id
    # prefix caching (managers/prefix_caching.py)
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache, summed over admissions
    cache_node: Optional[object] = None  # the radix-tree node this request keeps locked
    resume_state: Optional[object] = None  # its latest ResumeState (at a page boundary)
    # speculative decoding (speculative/mtp.py): tokens the MTP layer drafted for the next
    # step (mtp.DeviceDrafts: their values reach the host lazily), and with sampling their
    # draft distributions [k, vocab]
    spec_drafts: Sequence[int] = field(default_factory=list)
    spec_draft_probs: Optional[torch.Tensor] = None

    def __post_init__(self):
        assert len(self.origin_input_ids) > 0, "a request needs at least one prompt token"

    @classmethod
    def from_input(cls, req_in: GenerateReqInput, vocab_size: int, context_length: int, max_tokens: int, *,
                   has_tokenizer: bool, arrival_seq: int) -> "Req":
        """A queued request from its input; ValueError when it can never be served (the
        prompt's ids and length, the sampling and logprob arguments, stop strings without a
        tokenizer to match them)."""
        params = req_in.sampling_params
        if isinstance(params, dict):
            params = SamplingParams.from_dict(params)
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams or a dict, got {type(params).__name__}")
        params.verify(vocab_size)
        if params.stop and not has_tokenizer:
            raise ValueError("stop strings need a tokenizer; this scheduler has no decode_fn")
        if not isinstance(req_in.rid, str) or not req_in.rid:
            raise ValueError(f"rid must be a non-empty string, got {req_in.rid!r}")
        ids = check_prompt_ids(req_in.input_ids, vocab_size, context_length, max_tokens)
        check_logprob_args(req_in.return_logprob, req_in.top_logprobs_num)
        return cls(rid=req_in.rid, origin_input_ids=list(ids), sampling_params=params, stream=req_in.stream,
                   return_logprob=req_in.return_logprob, top_logprobs_num=req_in.top_logprobs_num,
                   arrival_seq=arrival_seq, generator=make_generator(params.seed) if params.seed is not None else None)

    def token_out(self) -> TokenOut:
        """The outputs since the last report (marked reported), with the request's state."""
        sent, self.num_sent = self.num_sent, len(self.output_ids)
        return TokenOut(
            rid=self.rid,
            new_token_ids=self.output_ids[sent:],
            finished=self.finished,
            finish_reason=self.finish_reason,
            prompt_tokens=len(self.origin_input_ids),
            completion_tokens=len(self.output_ids),
            error=self.error,
            new_logprobs=self.output_logprobs[sent:] if self.return_logprob else None,
            new_top_logprobs=self.output_top_logprobs[sent:] if self.top_logprobs_num else None,
            cached_tokens=self.cached_tokens,
        )

    @property
    def seq_len(self) -> int:
        """Prompt plus generated tokens, in-flight ones included (the last generated one is not
        in the KV cache yet)."""
        return len(self.origin_input_ids) + len(self.output_ids) + len(self.pending_ids)

    @property
    def num_generated(self) -> int:
        """Output tokens sampled so far, known or in flight."""
        return len(self.output_ids) + len(self.pending_ids)

    @property
    def num_pending_tokens(self) -> int:
        return self.seq_len - self.prefix_len

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def token_slice(self, start: int, end: int) -> List[int]:
        """token_ids[start:end] of prompt + output + placeholders, copying only the slice (a
        decode row's one token every step: never the whole output)."""
        parts, offset = [], 0
        for seq in (self.origin_input_ids, self.output_ids, self.pending_ids):
            lo, hi = max(start - offset, 0), min(end - offset, len(seq))
            if lo < hi:
                parts.append(seq[lo:hi])
            offset += len(seq)
        return parts[0] if len(parts) == 1 else [t for part in parts for t in part]


@dataclass
class ScheduleBatch:
    """One forward's requests: prefill chunks first, then decode rows (one token each, plus
    its drafts under speculative decoding)."""

    reqs: List[Req]
    extend_lens: List[int]  # tokens fed per request this step
    num_prefill_reqs: int  # the leading reqs are prefill chunks, the rest decode rows
    drafts: Optional[List[List[int]]] = None  # per decode row: the draft tokens it feeds after its own

    @classmethod
    def of(cls, prefill: List[Tuple[Req, int]], decode: List[Req],
           drafts: Optional[List[List[int]]] = None) -> Optional["ScheduleBatch"]:
        """The batch of prefill chunks (req, tokens) and decode rows (with their drafts), or
        None when both are empty."""
        if not prefill and not decode:
            return None
        drafts = drafts or [[] for _ in decode]
        return cls(reqs=[r for r, _ in prefill] + decode, extend_lens=[n for _, n in prefill] + [1 + len(d) for d in drafts],
                   num_prefill_reqs=len(prefill), drafts=drafts if any(drafts) else None)

    def __post_init__(self):
        assert self.reqs and len(self.reqs) == len(self.extend_lens)
        assert all(n >= 1 for n in self.extend_lens)
        drafts = self.drafts or [[]] * (len(self.reqs) - self.num_prefill_reqs)
        assert len(drafts) == len(self.reqs) - self.num_prefill_reqs
        assert [n - 1 for n in self.extend_lens[self.num_prefill_reqs:]] == [len(d) for d in drafts], \
            "decode rows feed one token and their drafts"

    @property
    def forward_mode(self) -> ForwardMode:
        if self.num_prefill_reqs == len(self.reqs):
            return ForwardMode.EXTEND
        if self.drafts and any(self.drafts):  # verify rows: extends of several tokens
            return ForwardMode.MIXED if self.num_prefill_reqs else ForwardMode.EXTEND
        return ForwardMode.MIXED if self.num_prefill_reqs else ForwardMode.DECODE

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)

    def completes(self, i: int) -> bool:
        """Whether row i feeds the request's last pending token (then its logits are sampled);
        a chunk that is not the request's final chunk samples nothing."""
        if i >= self.num_prefill_reqs:
            return True
        return self.reqs[i].prefix_len + self.extend_lens[i] == self.reqs[i].seq_len

    def has_placeholders(self) -> bool:
        """Whether a fed token is still in flight (the forward's ids need resolving)."""
        return any(r.pending_ids for r in self.reqs)

    def to_forward_batch(self, device) -> ForwardBatch:
        drafts = [[]] * self.num_prefill_reqs + (self.drafts or [[]] * (len(self.reqs) - self.num_prefill_reqs))
        return build_forward_batch(
            self.forward_mode,
            req_pool_indices=[r.req_pool_idx for r in self.reqs],
            prefix_lens=[r.prefix_len for r in self.reqs],
            new_token_ids=[r.token_slice(r.prefix_len, r.prefix_len + n - len(d)) + d
                           for r, n, d in zip(self.reqs, self.extend_lens, drafts)],
            device=device,
        )


def eos_ids_of(config) -> frozenset:
    eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return frozenset()
    return frozenset(eos if isinstance(eos, (list, tuple)) else [eos])


def check_finished(req: Req, eos_token_ids: frozenset, context_length: int, decode_fn=None) -> Optional[dict]:
    """Finish reason after `req` got a new known token (its output_ids[-1]), or None. Stop
    conditions win over length when both hold on the same token: the model did stop there."""
    p = req.sampling_params
    tok = req.output_ids[-1]
    if tok in p.stop_token_ids or (not p.ignore_eos and tok in eos_token_ids):
        return {"type": "stop", "matched": tok}
    if p.stop and decode_fn is not None:
        matched = _match_stop_string(req.output_ids, p.stop, decode_fn)
        if matched is not None:
            return {"type": "stop", "matched": matched}
    if len(req.output_ids) >= p.max_new_tokens or len(req.origin_input_ids) + len(req.output_ids) >= context_length:
        return {"type": "length", "length": len(req.output_ids)}
    return None


def _match_stop_string(output_ids: Sequence[int], stops: Sequence[str], decode_fn) -> Optional[str]:
    """A stop string in the decoded tail of the output. Checked after every token, so a match
    can only involve the newest token; a tail of 4 ids per character (the worst case of a
    byte-level tokenizer on UTF-8) plus slack covers the longest stop string."""
    window = 4 * max(len(s) for s in stops) + 4
    tail = decode_fn(list(output_ids[-window:]))
    for s in stops:
        if s in tail:
            return s
    return None
