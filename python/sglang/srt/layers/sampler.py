"""Next-token logits [B, V] + each request's SamplingParams -> token ids [B].

Greedy rows (temperature 0 or top_k 1) take the argmax and never pay for the sort. Sampled
rows go through temperature, top-k, top-p, min-p (in that order, each on the distribution the
previous one left, as Hugging Face's warpers do) and inverse-CDF sampling in sorted order.
The one random number a sampled row consumes per token comes from a CPU generator: the
request's own (seeded) one, else the sampler's (seeded by --random-seed). Drawing it on the
host makes a seeded row's tokens independent of its batch neighbours and of the device.
Nothing here waits for the GPU: host-built tensors go up with non-blocking copies and the ids
stay on the device (the overlap scheduler reads them one step later).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from sglang.srt.model_executor.host_to_device import to_device_async
from sglang.srt.sampling.sampling_params import SamplingParams


def make_generator(seed: int) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g


class Sampler:
    def __init__(self, seed: int = 0):
        self.generator = make_generator(seed)  # for requests without a seed of their own

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Optional[Sequence[Optional[torch.Generator]]] = None,
    ) -> torch.Tensor:
        """Returns int64 token ids [B] on logits.device; `generators[i]` (CPU) serves row i when
        not None. Each sampled row draws exactly one uniform per call."""
        batch, vocab = logits.shape
        if len(params) != batch:
            raise ValueError(f"{batch} logits rows but {len(params)} sampling params")
        if generators is None:
            generators = [None] * batch
        out = torch.empty(batch, dtype=torch.int64, device=logits.device)
        greedy = [i for i, p in enumerate(params) if p.is_greedy]
        sampled = [i for i, p in enumerate(params) if not p.is_greedy]
        if len(greedy) == batch:
            return torch.argmax(logits, dim=-1)
        if greedy:
            g_idx = to_device_async(torch.tensor(greedy, dtype=torch.int64), logits.device)
            out[g_idx] = torch.argmax(logits[g_idx], dim=-1)
        s_idx = to_device_async(torch.tensor(sampled, dtype=torch.int64), logits.device)
        rows = logits if not greedy else logits[s_idx]
        uniforms = torch.cat([
            torch.rand(1, generator=self.generator if generators[i] is None else generators[i])
            for i in sampled
        ])
        out[s_idx] = _sample_rows(rows, [params[i] for i in sampled], uniforms)
        return out


def _sample_rows(logits: torch.Tensor, params: Sequence[SamplingParams], uniforms: torch.Tensor) -> torch.Tensor:
    """Filtered sampling for non-greedy rows; uniforms: [S] in [0, 1) on the CPU."""
    dev = logits.device
    vocab = logits.shape[-1]
    # one upload: the filter parameters and the uniforms
    table = to_device_async(torch.cat([_param_table(params, vocab), uniforms.float()[:, None]], dim=1), dev)
    temps, top_ps, min_ps, u = table[:, 0], table[:, 2], table[:, 3], table[:, 4]
    top_ks = table[:, 1].long()

    sorted_ids, probs = _filtered_sorted(logits, temps, top_ks, top_ps, min_ps)
    # inverse CDF on the unnormalised kept mass: first index whose cumulative mass exceeds u
    cdf = torch.cumsum(probs, dim=-1)
    target = u * cdf[:, -1]
    choice = torch.searchsorted(cdf, target[:, None], right=True).clamp_(max=vocab - 1)
    return sorted_ids.gather(1, choice).squeeze(1)


def _param_table(params: Sequence[SamplingParams], vocab: int) -> torch.Tensor:
    """[S, 4] fp32 on the CPU: temperature, top_k (a top_k past the vocabulary means all of it:
    it may be any JSON integer; exact in float32 below 2^24), top_p, min_p."""
    return torch.tensor([[p.temperature, min(p.top_k, vocab) if p.top_k > 0 else vocab, p.top_p, p.min_p]
                         for p in params], dtype=torch.float32)


def _filtered_sorted(logits, temps, top_ks, top_ps, min_ps):
    """(ids in descending order of logit, their unnormalised kept mass) after temperature,
    top-k, top-p and min-p, each on the distribution the previous one left."""
    vocab = logits.shape[-1]
    x = logits.float() / temps[:, None]
    # stable: among equal logits the lower id ranks first, matching argmax's tie-break
    sorted_logits, sorted_ids = torch.sort(x, dim=-1, descending=True, stable=True)
    probs = torch.softmax(sorted_logits, dim=-1)
    ranks = torch.arange(vocab, device=logits.device)
    probs = probs * (ranks[None, :] < top_ks[:, None])
    # top-p on the top-k distribution: keep the smallest prefix whose mass reaches top_p of
    # what top-k kept (the first token always stays: its exclusive mass is 0). Rows with
    # top_p == 1 skip the test so float rounding in the cumsum never drops a tail token.
    cum = torch.cumsum(probs, dim=-1)
    exclusive = cum - probs
    threshold = torch.where(top_ps >= 1, torch.full_like(top_ps, float("inf")), top_ps * cum[:, -1])
    probs = probs * (exclusive < threshold[:, None])
    # min-p is relative to the most likely token, so renormalisation does not change it
    return sorted_ids, probs * (probs >= min_ps[:, None] * probs[:, :1])


def sampling_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution each (non-greedy) row samples from, in vocabulary order [B, V] fp32,
    normalised: _sample_rows' filtering. Speculative sampling compares the target's and the
    draft's with it."""
    table = to_device_async(_param_table(params, logits.shape[-1]), logits.device)
    sorted_ids, probs = _filtered_sorted(logits, table[:, 0], table[:, 1].long(), table[:, 2], table[:, 3])
    probs = probs / probs.sum(dim=-1, keepdim=True)
    return torch.zeros_like(probs).scatter_(1, sorted_ids, probs)


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draws from normalised rows [B, V] (vocabulary order) with uniforms [B] in
    [0, 1) (CPU): int64 ids [B]. A token of zero mass is never drawn."""
    cdf = torch.cumsum(probs, dim=-1)
    u = to_device_async(uniforms.float(), probs.device) * cdf[:, -1]
    choice = torch.searchsorted(cdf, u[:, None], right=True).clamp_(max=probs.shape[-1] - 1)
    return choice.squeeze(1)
