"""Log-probabilities of sampled tokens, for requests that ask for them (`return_logprob`).

They are the model's own distribution: log-softmax of the fp32 logits, before temperature and
top-k / top-p / min-p. That is what tells how close a greedy choice was (the gap to the
runner-up), and it does not depend on how the token was drawn. Computed on the device, for
the asking rows only, and read by the host with the step's sampled ids (no extra sync).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from dsv4_kernels.reference import topk_indices


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, top_n: int
                   ) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """logits [B, V], ids [B] (the sampled tokens) -> (logprob of each id [B] fp32, the top_n
    logprobs [B, top_n] fp32 most likely first, their ids [B, top_n] int64); the last two are
    None when top_n is 0. Ties in the top list go to the lower id (the deterministic top-k)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, ids.long()[:, None]).squeeze(1)
    if top_n == 0:
        return chosen, None, None
    top_ids = topk_indices(logp, min(top_n, logp.shape[-1]))
    return chosen, logp.gather(1, top_ids), top_ids
