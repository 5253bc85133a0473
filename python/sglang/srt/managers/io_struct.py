"""Every message that crosses a process boundary: requests and outputs between the
tokenizer/HTTP side (or the Engine) and the schedulers, and the start-up and control messages
between the DP controller and the scheduler processes.

Plain picklable dataclasses: token ids only, no text (detokenization is the caller's job).
Finish reasons are dicts so they serialize to JSON unchanged:
  {"type": "length", "length": 16}           max_new_tokens (or the context) reached
  {"type": "stop", "matched": 1}             a stop token (eos or stop_token_ids) was sampled
  {"type": "stop", "matched": "END"}         a stop string appeared in the decoded output
  {"type": "abort", "message": "..."}        aborted by the client, or failed (then `error` is set)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from sglang.srt.sampling.sampling_params import SamplingParams


# Most alternatives per generated token a request may ask for (`top_logprobs_num`).
MAX_TOP_LOGPROBS = 20


@dataclass
class GenerateReqInput:
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    stream: bool = False
    # Log-probabilities of the generated tokens under the model's distribution (the logits'
    # log-softmax: temperature 1, no top-k/p filtering), and of the `top_logprobs_num` most
    # likely tokens at each step.
    return_logprob: bool = False
    top_logprobs_num: int = 0


@dataclass
class AbortReq:
    rid: str


@dataclass
class TokenOut:
    """New tokens of one request since its previous TokenOut; the last one has finished=True.

    A matched stop token or the token that completed a stop string is included in the ids
    (it was generated and is counted in completion_tokens); `visible_output_ids` and
    `trim_stop_string` remove the matched stop from what a user sees.
    """

    rid: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: Optional[dict]
    prompt_tokens: int
    completion_tokens: int
    error: Optional[str] = None
    # With return_logprob: one per new token, and per new token its top_logprobs_num
    # (logprob, token id) pairs, most likely first.
    new_logprobs: Optional[list[float]] = None
    new_top_logprobs: Optional[list[list[tuple[float, int]]]] = None
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache (meta_info's cached_tokens)


@dataclass
class ServerInfoReq:
    pass


@dataclass
class ServerInfo:
    stats: dict[str, Any]


# ---- process lifecycle: scheduler processes <-> the DP controller ---------------------------

# Pipe control words (the parent to a scheduler process): stop, and wake from the idle wait.
SHUTDOWN = "shutdown"
# Sent by the DP controller to the other ranks with a request that reaches an idle server:
# they wake from their idle wait at once instead of making the new request's rank wait for
# them in the step's collective.
WAKE = "wake"


@dataclass
class ReadyMsg:
    server_args: object  # resolved here, where the device is: the server shows these
    context_length: int
    vocab_size: int
    pid: int
    stats: dict = field(default_factory=dict)
    dp_rank: int = 0


@dataclass
class StartupError:
    message: str  # the traceback
    summary: str = ""  # "ExcType: message", for the one line a user reads first
    dp_rank: int = 0


@dataclass
class RankHello:
    """First message of a DP rank that connects back to node 0 over TCP."""

    dp_rank: int
    node_rank: int


# ---- helpers ---------------------------------------------------------------------------------


class OutputsSoFar:
    """A request's output ids so far, and their logprobs / top logprobs when it asked (None
    otherwise): what every consumer of TokenOut chunks accumulates."""

    def __init__(self, return_logprob: bool = False, top_logprobs_num: int = 0):
        self.ids: list[int] = []
        self.logprobs: Optional[list[float]] = [] if return_logprob else None
        self.top_logprobs: Optional[list] = [] if top_logprobs_num else None

    def add(self, ids: Sequence[int], logprobs: Optional[Sequence[float]], top_logprobs: Optional[Sequence]) -> None:
        self.ids.extend(ids)
        if self.logprobs is not None:
            self.logprobs.extend(logprobs)
        if self.top_logprobs is not None:
            self.top_logprobs.extend(top_logprobs)

    def meta_info(self) -> dict:
        """The logprob fields of meta_info (logprob_meta_info), empty without logprobs."""
        return logprob_meta_info(self.ids, self.logprobs, self.top_logprobs) if self.logprobs is not None else {}


def logprob_meta_info(output_ids: Sequence[int], logprobs: Optional[Sequence[float]],
                      top_logprobs: Optional[Sequence[Sequence[tuple[float, int]]]]) -> dict:
    """meta_info fields of a request with return_logprob, SGLang's shape without token texts:
    `output_token_logprobs` [[logprob, token_id, null], ...] per output id, and
    `output_top_logprobs` a list of such triples per output id, most likely first."""
    meta = {}
    if logprobs is not None:
        meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(logprobs, output_ids)]
    if top_logprobs is not None:
        meta["output_top_logprobs"] = [[[lp, tok, None] for lp, tok in step] for step in top_logprobs]
    return meta


def check_logprob_args(return_logprob, top_logprobs_num) -> None:
    """ValueError unless return_logprob is a bool and top_logprobs_num an int in
    [0, MAX_TOP_LOGPROBS], non-zero only with return_logprob."""
    if not isinstance(return_logprob, bool):
        raise ValueError(f"return_logprob must be true or false, got {return_logprob!r}")
    if isinstance(top_logprobs_num, bool) or not isinstance(top_logprobs_num, int) \
            or not 0 <= top_logprobs_num <= MAX_TOP_LOGPROBS:
        raise ValueError(f"top_logprobs_num must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {top_logprobs_num!r}")
    if top_logprobs_num and not return_logprob:
        raise ValueError("top_logprobs_num needs return_logprob")


def visible_output_ids(output_ids: Sequence[int], finish_reason: Optional[dict]) -> list[int]:
    """Output ids without a matched stop token (the stop token ends the text, it is not text)."""
    ids = list(output_ids)
    if finish_reason and finish_reason.get("type") == "stop" and isinstance(finish_reason.get("matched"), int):
        if ids and ids[-1] == finish_reason["matched"]:
            ids.pop()
    return ids


def trim_stop_string(text: str, finish_reason: Optional[dict]) -> str:
    """Cut the text before a matched stop string. The scheduler stops at the first token that
    completes any stop string, so the first occurrence in the output text is the match."""
    if finish_reason and finish_reason.get("type") == "stop" and isinstance(finish_reason.get("matched"), str):
        at = text.find(finish_reason["matched"])
        if at >= 0:
            return text[:at]
    return text


def output_text(decode: Callable[[list[int]], str], output_ids: Sequence[int], finish_reason: Optional[dict]) -> str:
    """The user-visible text of a finished request."""
    return trim_stop_string(decode(visible_output_ids(output_ids, finish_reason)), finish_reason)


def kv_capacity_tokens(stats: dict) -> Optional[int]:
    """KV tokens a rank holds, from its scheduler stats (None when not reported)."""
    if "num_total_pages" not in stats or "page_size" not in stats:
        return None
    return stats["num_total_pages"] * stats["page_size"]


def check_prompt_ids(ids, vocab_size: int, context_length: int,
                     kv_capacity: Optional[int] = None) -> list:
    """The prompt checks every entry point shares (scheduler, HTTP side, DP Engine): a
    non-empty list of in-vocabulary ints that leaves room for output in the context and fits
    the KV cache. Raises ValueError naming the problem; returns the ids as a list."""
    if not isinstance(ids, (list, tuple)) or not ids:
        raise ValueError("input_ids must be a non-empty list of token ids")
    # Lengths first: a huge list is refused without a scan over every element.
    if len(ids) >= context_length:
        raise ValueError(f"the prompt has {len(ids)} tokens but the context length is {context_length} "
                         "(at least one position must remain for output)")
    if kv_capacity is not None and len(ids) > kv_capacity:
        raise ValueError(f"the prompt has {len(ids)} tokens but the KV cache holds only {kv_capacity} "
                         "(--max-total-tokens)")
    none = object()  # not None: None is itself a bad token id
    bad = next((t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size), none)
    if bad is not none:
        shown = repr(bad) if isinstance(bad, (int, float, bool, type(None))) else type(bad).__name__
        raise ValueError(f"input_ids must be integers in [0, {vocab_size}): token id {shown} is outside "
                         "the vocabulary")
    return list(ids)

