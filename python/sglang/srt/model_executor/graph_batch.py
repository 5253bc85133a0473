"""Static input buffers of a graph runner: the live batch is copied into the first n rows,
padding rows get neutral values (token 0, position 0, the padding request), and a
ForwardBatch of views over the first `bucket` rows is what the graph captured."""

from __future__ import annotations

from typing import Optional

import torch

from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode


class StaticBatchBuffers:
    def __init__(self, max_tokens: int, hidden_size: int, padding_slot: int, embed_dtype: torch.dtype,
                 device: torch.device):
        self.padding_slot = padding_slot
        self.input_ids = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.int64, device=device)
        # padding rows belong to the padding request; the metadata builder marks rows past
        # the requests' tokens invalid (write slot -1, empty lists)
        self.token_req_slot = torch.full((max_tokens,), padding_slot, dtype=torch.int64, device=device)
        self.input_embeds = torch.zeros(max_tokens, hidden_size, dtype=embed_dtype, device=device)

    def fill(self, live: Optional[ForwardBatch], bucket: int) -> None:
        """Copy the live batch in (rows [:n]) and neutralise the padding rows [n:bucket]."""
        n = 0 if live is None else live.num_tokens
        if live is not None:
            if live.input_embeds is not None:
                self.input_embeds[:n].copy_(live.input_embeds)
            self.input_ids[:n].copy_(live.input_ids)  # hash-routed layers need ids either way
            self.positions[:n].copy_(live.positions)
            self.token_req_slot[:n].copy_(live.token_req_slot)
        self.input_ids[n:bucket].zero_()
        self.input_embeds[n:bucket].zero_()
        self.positions[n:bucket].zero_()
        self.token_req_slot[n:bucket].fill_(self.padding_slot)

    def forward_batch(self, live: Optional[ForwardBatch], bucket: int,
                      mode: ForwardMode = ForwardMode.EXTEND) -> ForwardBatch:
        """A batch of views over the static buffers; request lists are the live ones."""
        if live is None:
            lists = dict(seq_lens_cpu=[], extend_seq_lens_cpu=[], extend_prefix_lens_cpu=[])
            n, embeds, extra = 0, None, {}
        else:
            lists = dict(seq_lens_cpu=live.seq_lens_cpu, extend_seq_lens_cpu=live.extend_seq_lens_cpu,
                         extend_prefix_lens_cpu=live.extend_prefix_lens_cpu)
            n, mode = live.num_tokens, live.forward_mode
            embeds = self.input_embeds[:bucket] if live.input_embeds is not None else None
            extra = dict(return_all_logits=live.return_all_logits, dp=live.dp)
        return ForwardBatch(
            forward_mode=mode,
            input_ids=self.input_ids[:bucket],
            positions=self.positions[:bucket],
            token_req_slot=self.token_req_slot[:bucket],
            input_embeds=embeds,
            num_live_tokens=n,
            **lists,
            **extra,
        )
