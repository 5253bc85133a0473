"""Static input buffers shared by the graph runners: the live batch is copied into the
first n rows, padding rows get neutral values (padding request, position 0, write slot -1),
and a ForwardBatch of views over the first `bucket` rows is what the graph captured."""

from __future__ import annotations

from typing import Optional

import torch

from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode


class StaticBatchBuffers:
    def __init__(self, max_tokens: int, max_bs: int, hidden_size: int, padding_slot: int,
                 loc_dtype: torch.dtype, embed_dtype: torch.dtype, device: torch.device):
        self.padding_slot = padding_slot
        z = lambda n, dt: torch.zeros(n, dtype=dt, device=device)  # noqa: E731
        self.input_ids = z(max_tokens, torch.int64)
        self.positions = z(max_tokens, torch.int64)
        # dtype follows the KV pools' slot index dtype so copies never convert on the hot path
        self.out_cache_loc = torch.full((max_tokens,), -1, dtype=loc_dtype, device=device)
        self.token_req_slot = torch.full((max_tokens,), padding_slot, dtype=torch.int64, device=device)
        self.input_embeds = torch.zeros(max_tokens, hidden_size, dtype=embed_dtype, device=device)
        self.req_pool_indices = torch.full((max_bs,), padding_slot, dtype=torch.int64, device=device)
        self.seq_lens = z(max_bs, torch.int32)
        self.extend_seq_lens = z(max_bs, torch.int32)
        self.extend_prefix_lens = z(max_bs, torch.int32)

    def fill(self, live: Optional[ForwardBatch], bucket: int, bs_bucket: int) -> None:
        """Copy the live batch in (rows [:n]) and neutralise the padding rows [n:bucket]."""
        n = 0 if live is None else live.num_tokens
        b = 0 if live is None else live.batch_size
        if live is not None:
            if live.input_embeds is not None:
                self.input_embeds[:n].copy_(live.input_embeds)
            self.input_ids[:n].copy_(live.input_ids)  # hash-routed layers need ids either way
            self.positions[:n].copy_(live.positions)
            self.out_cache_loc[:n].copy_(live.out_cache_loc)
            self.token_req_slot[:n].copy_(live.token_req_slot)
            self.req_pool_indices[:b].copy_(live.req_pool_indices)
            self.seq_lens[:b].copy_(live.seq_lens)
            self.extend_seq_lens[:b].copy_(live.extend_seq_lens)
            self.extend_prefix_lens[:b].copy_(live.extend_prefix_lens)
        self.input_ids[n:bucket].zero_()
        self.input_embeds[n:bucket].zero_()
        self.positions[n:bucket].zero_()
        self.out_cache_loc[n:bucket].fill_(-1)
        self.token_req_slot[n:bucket].fill_(self.padding_slot)
        self.req_pool_indices[b:bs_bucket].fill_(self.padding_slot)
        self.seq_lens[b:bs_bucket].zero_()
        self.extend_seq_lens[b:bs_bucket].zero_()
        self.extend_prefix_lens[b:bs_bucket].zero_()

    def forward_batch(self, live: Optional[ForwardBatch], bucket: int, bs: int,
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
            out_cache_loc=self.out_cache_loc[:bucket],
            token_req_slot=self.token_req_slot[:bucket],
            req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs],
            extend_seq_lens=self.extend_seq_lens[:bs],
            extend_prefix_lens=self.extend_prefix_lens[:bs],
            input_embeds=embeds,
            num_real_tokens=n,
            **lists,
            **extra,
        )

