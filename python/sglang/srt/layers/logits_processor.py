"""Logits of the rows a batch asks for: each request's last token, or every token."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class LogitsOutput:
    next_token_logits: torch.Tensor  # [batch_size, vocab] fp32
    all_logits: Optional[torch.Tensor] = None  # [num_live_tokens, vocab] when requested


def compute_logits(model, hidden: torch.Tensor, forward_batch) -> LogitsOutput:
    n = forward_batch.num_live_tokens
    if forward_batch.return_all_logits:
        all_logits = model.compute_logits(hidden[:n])
        return LogitsOutput(all_logits[forward_batch.last_token_indices()], all_logits)
    return LogitsOutput(model.compute_logits(hidden[forward_batch.last_token_indices()]))
