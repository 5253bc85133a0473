"""What one forward step must move and compute, from the config alone: the physical limit a
measured step is judged against. A decode step is bound by HBM (every weight it touches and
the KV it reads, once), a prefill step by FLOPs. Arithmetic, not a profile: the numbers a
perfect kernel set would reach on one GPU.

Per GPU, for a rank holding 1/ep of the routed experts and a replica of everything else:
- weights touched: every replicated weight of the main layers and the head (the MTP layers do
  not run in a plain step; the embedding table is only gathered), plus, per layer, the local
  routed experts the step's tokens hit. Under uniform routing a batch of B tokens choosing k
  of n experts hits n * (1 - (1 - k/n)^B) of them in expectation (with EP every rank's experts
  see the tokens of every rank, so B is the global batch).
- KV read per decode token and layer: the sliding window's raw rows; on ratio-4 layers the
  indexer's key for every compressed entry plus the top-k compressed rows attention reads; on
  ratio-128 layers every compressed row.
- FLOPs per token: 2 x the multiply-adds of every projection and of the k routed + shared
  experts, plus the attention core (scores and values over the keys it reads).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from sglang.srt.planning.meta_model import meta_tensors


@dataclass(frozen=True)
class Ceilings:
    """One GPU's datasheet peaks (dense tensor-core math, HBM bandwidth): the ceilings a measured
    step is judged against."""

    name: str
    hbm_bytes_per_s: float
    bf16_flops: float
    fp8_flops: float

    def peak_flops(self, fp8: bool) -> float:
        return self.fp8_flops if fp8 else self.bf16_flops


H200 = Ceilings("H200 SXM", 4.8e12, 989e12, 1979e12)
# Most specific first: a name matches the first entry all of whose words it contains.
_KNOWN = (
    (("H200", "NVL"), Ceilings("H200 NVL", 4.8e12, 835e12, 1671e12)),
    (("H200",), H200),
    (("H100", "PCIE"), Ceilings("H100 PCIe", 2.0e12, 756e12, 1513e12)),
    (("H100", "NVL"), Ceilings("H100 NVL", 3.9e12, 835e12, 1671e12)),
    (("H100",), Ceilings("H100 SXM", 3.35e12, 989e12, 1979e12)),
)


def ceilings_for(device_name: str | None) -> Ceilings | None:
    """The ceilings of a GPU by its name (torch.cuda.get_device_name), None for one not known
    here: a bound computed with another GPU's peaks would be wrong, not approximate."""
    upper = (device_name or "").upper()
    for words, ceilings in _KNOWN:
        if all(w in upper for w in words):
            return ceilings
    return None

_LAYER = re.compile(r"^layers\.(\d+)\.")
_EXPERTS = re.compile(r"\.ffn\.experts\.")


@dataclass(frozen=True)
class ModelBytes:
    """Bytes of the weights a step can touch, as the model holds them."""

    dense: int  # main layers' replicated weights + head + final norms (read by every step)
    expert_per_layer: int  # one routed expert of one layer (all its matrices and scales)
    embed_row: int  # one embedding row (gathered per token)


def model_bytes(config, dtype: str = "bfloat16") -> ModelBytes:
    """Sizes from the model built on the meta device (planning/meta_model.py; the release
    format's FP8 / FP4 modules count at their stored size)."""
    dense = experts = 0
    embed_row = 0
    for t in meta_tensors(config, dtype):
        if t.name.startswith("mtp."):
            continue
        if t.name.startswith("embed."):
            embed_row = t.nbytes // t.shape[0]
        elif _EXPERTS.search(t.name) and _LAYER.match(t.name):
            experts += t.nbytes
        elif t.name.startswith(("layers.", "head", "hc_head", "norm")):
            dense += t.nbytes
    per_expert = experts // (config.num_hidden_layers * config.n_routed_experts)
    return ModelBytes(dense, per_expert, embed_row)


def expected_experts_hit(num_experts: int, topk: int, tokens: int) -> float:
    """Expected distinct experts that `tokens` uniformly routed top-k picks hit."""
    return num_experts * (1.0 - (1.0 - topk / num_experts) ** tokens)


def kv_read_bytes_per_token(config, context: int, kv_row_bytes: int, index_key_bytes: int) -> int:
    """KV bytes one decode token reads over all layers at `context` cached tokens."""
    total = 0
    for layer in range(config.num_hidden_layers):
        total += min(context, config.sliding_window) * kv_row_bytes
        r = config.layer_compress_ratio(layer)
        if r == 4:
            entries = context // 4
            total += entries * index_key_bytes + min(entries, config.index_topk) * kv_row_bytes
        elif r:
            total += (context // r) * kv_row_bytes
    return total


@dataclass(frozen=True)
class DecodeCost:
    weight_bytes: float
    kv_bytes: int

    @property
    def total_bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes

    def seconds(self, ceilings: Ceilings = H200) -> float:
        return self.total_bytes / ceilings.hbm_bytes_per_s


def decode_step_cost(config, batch: int, context: int, *, ep_size: int = 1, global_batch: int | None = None,
                     kv_row_bytes: int | None = None, index_key_bytes: int | None = None,
                     dtype: str = "bfloat16", bytes_: ModelBytes | None = None) -> DecodeCost:
    """HBM bytes of one decode step of `batch` rows (this rank's) at `context` cached tokens,
    on a rank holding 1/ep_size of the routed experts. global_batch: the tokens every rank's
    MoE sees (default batch * ep_size, i.e. equal ranks). kv_row_bytes: a compressed / raw KV
    row (default head_dim in the model dtype; 584 for the FP8 layout). index_key_bytes: an
    indexer key (default index_head_dim in the model dtype; 68 packed FP4). bytes_: model_bytes's
    result, when the caller computes several steps."""
    mb = model_bytes(config, dtype) if bytes_ is None else bytes_
    elt = 4 if dtype == "float32" else 2
    row = kv_row_bytes if kv_row_bytes is not None else config.head_dim * elt
    tokens = global_batch if global_batch is not None else batch * ep_size
    local = config.n_routed_experts // ep_size
    # the local experts hit: each of the global tokens' k picks lands on this rank with prob 1/ep
    hit = expected_experts_hit(config.n_routed_experts, config.num_experts_per_tok, tokens) * local \
        / config.n_routed_experts
    weights = mb.dense + batch * mb.embed_row + config.num_hidden_layers * hit * mb.expert_per_layer
    key = index_key_bytes if index_key_bytes is not None else config.index_head_dim * elt
    kv = batch * kv_read_bytes_per_token(config, context, row, key)
    return DecodeCost(weights, kv)


def flops_per_token(config, context: int) -> float:
    """Forward FLOPs of one token over all main layers (matrices + attention core) at
    `context` tokens before it."""
    h, H, d = config.hidden_size, config.num_attention_heads, config.head_dim
    inter = config.moe_intermediate_size
    # projections: q (a, b), kv, output (grouped a, then b), the router
    dense = h * config.q_lora_rank + config.q_lora_rank * H * d + h * d
    dense += H * d * config.o_lora_rank + config.o_groups * config.o_lora_rank * h
    dense += h * config.n_routed_experts
    # experts: k routed + shared, gate / up / down
    dense += (config.num_experts_per_tok + config.n_shared_experts) * 3 * h * inter
    macs = config.num_hidden_layers * dense
    for layer in range(config.num_hidden_layers):
        r = config.layer_compress_ratio(layer)
        keys = min(context + 1, config.sliding_window)
        if r == 4:  # compressor (kv + gate, two overlapping windows), indexer q / weights / keys
            macs += 2 * h * 2 * d + config.q_lora_rank * config.index_n_heads * config.index_head_dim
            macs += h * config.index_n_heads + 2 * h * 2 * config.index_head_dim
            macs += (context // 4) * config.index_n_heads * config.index_head_dim  # indexer scores
            keys += min(context // 4, config.index_topk)
        elif r:
            macs += 2 * h * d
            keys += context // r
        macs += 2 * H * d * keys  # attention core: scores and values, every head
    return 2.0 * macs
