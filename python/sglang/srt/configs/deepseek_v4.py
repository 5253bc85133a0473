"""DeepseekV4Config: the Hugging Face config.json of a DeepSeek-V4 checkpoint, validated once.

Attribute names are exactly the config.json field names, so a real checkpoint's config loads
unchanged and `to_dict()` writes it back; fields this runtime does not know are kept in `extra`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

COMPRESS_RATIOS = (0, 4, 128)
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")
_YARN_KEYS = ("factor", "beta_fast", "beta_slow", "original_max_position_embeddings")


class ConfigError(ValueError):
    """An invalid model config; the message starts with the offending field's name."""


@dataclass(frozen=True, kw_only=True)
class DeepseekV4Config:
    # Required: the model's dimensions have no meaningful default.
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    compress_ratios: list[int]
    max_position_embeddings: int

    # Optional: the release's value for architecture constants (window, mHC, RoPE), a neutral
    # one (no clamp, scale 1, no hash layers, no MTP) for per-model choices.
    num_key_value_heads: int = 1
    n_shared_experts: int = 1
    scoring_func: str = "sqrtsoftplus"
    topk_method: str = "noaux_tc"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    swiglu_limit: float = 0.0  # 0 means no clamp
    shared_expert_swiglu_limit: bool = True  # whether the shared expert clamps too
    num_hash_layers: int = 0
    sliding_window: int = 128
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: dict[str, Any] | None = None
    rms_norm_eps: float = 1e-6
    num_nextn_predict_layers: int = 0
    bos_token_id: int = 0
    eos_token_id: int | list[int] = 1
    tie_word_embeddings: bool = False
    torch_dtype: str = "bfloat16"
    expert_dtype: str | None = None
    quantization_config: dict[str, Any] | None = None
    architectures: list[str] = field(default_factory=lambda: ["DeepseekV4ForCausalLM"])
    model_type: str = "deepseek_v4"

    # config.json fields this runtime does not read (attention_bias, use_cache, ...).
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        _validate(self)

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DeepseekV4Config:
        if not isinstance(d, dict):
            raise ConfigError(f"config: expected a JSON object, got {type(d).__name__}")
        known = {f.name: f for f in dataclasses.fields(cls) if f.name != "extra"}
        for name, f in known.items():
            if name not in d and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"{name}: required field is missing")
        kwargs = {k: v for k, v in d.items() if k in known}
        extra = {k: v for k, v in d.items() if k not in known}
        return cls(**kwargs, extra=extra)

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> DeepseekV4Config:
        with open(path) as f:
            return cls.from_dict(json.load(f))

    def to_dict(self) -> dict[str, Any]:
        """The config.json form: Hugging Face names, with the unknown fields put back."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        return json.loads(json.dumps({**d, **self.extra}))  # a deep copy the caller may edit

    # ---- derived ------------------------------------------------------------------------

    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    @property
    def num_layers_with_mtp(self) -> int:
        return self.num_hidden_layers + self.num_nextn_predict_layers

    @property
    def num_mtp_layers(self) -> int:
        """MTP layers the model builds: those compress_ratios lists (a checkpoint's MTP weights
        load into them)."""
        return self.num_nextn_predict_layers if len(self.compress_ratios) > self.num_hidden_layers else 0

    def layer_compress_ratio(self, layer_id: int) -> int:
        """Compress ratio of a layer; ids past num_hidden_layers are MTP layers, when listed."""
        if not 0 <= layer_id < len(self.compress_ratios):
            raise IndexError(
                f"layer_id {layer_id} out of range: compress_ratios has {len(self.compress_ratios)} entries"
            )
        return self.compress_ratios[layer_id]

    def is_hash_layer(self, layer_id: int) -> bool:
        return layer_id < self.num_hash_layers

    @property
    def rope_factor(self) -> float:
        return float(self.rope_scaling["factor"]) if self.rope_scaling else 1.0

    @property
    def beta_fast(self) -> float:
        return float(self.rope_scaling["beta_fast"]) if self.rope_scaling else 32.0

    @property
    def beta_slow(self) -> float:
        return float(self.rope_scaling["beta_slow"]) if self.rope_scaling else 1.0

    @property
    def original_max_position_embeddings(self) -> int:
        return int(self.rope_scaling["original_max_position_embeddings"]) if self.rope_scaling else 0

    @property
    def fp8_linears(self) -> bool:
        """Projection weights stored FP8 e4m3 with 128x128 power-of-two block scales."""
        return self.quantization_config is not None

    @property
    def fp4_experts(self) -> bool:
        """Routed experts stored as packed FP4 e2m1 with a ue8m0 scale per 32 inputs."""
        return self.expert_dtype == "fp4"

    @property
    def is_quantized(self) -> bool:
        return self.fp8_linears or self.fp4_experts

    @property
    def fp8_weight_block_size(self) -> tuple[int, int] | None:
        return (FP8_BLOCK, FP8_BLOCK) if self.fp8_linears else None

    @property
    def fp8_scale_fmt(self) -> str | None:
        """"ue8m0" (F8_E8M0 scale tensors) or None (fp32 scales)."""
        return (self.quantization_config or {}).get("scale_fmt")


# ---- validation ---------------------------------------------------------------------------

# Minimum value of every integer field.
_INT_MIN = {
    "vocab_size": 1,
    "hidden_size": 1,
    "num_hidden_layers": 1,
    "num_attention_heads": 1,
    "num_key_value_heads": 1,
    "head_dim": 1,
    "qk_rope_head_dim": 1,
    "q_lora_rank": 1,
    "o_groups": 1,
    "o_lora_rank": 1,
    "n_routed_experts": 1,
    "n_shared_experts": 0,
    "num_experts_per_tok": 1,
    "moe_intermediate_size": 1,
    "num_hash_layers": 0,
    "sliding_window": 1,
    "index_n_heads": 1,
    "index_head_dim": 1,
    "index_topk": 0,  # only c4 layers use it; checked against compress_ratios below
    "hc_mult": 1,
    "hc_sinkhorn_iters": 1,
    "num_nextn_predict_layers": 0,
    "max_position_embeddings": 1,
    "bos_token_id": 0,
}
# Float fields: True when the value must be > 0, False when >= 0 suffices.
_FLOAT_POSITIVE = {
    "routed_scaling_factor": True,
    "swiglu_limit": False,
    "hc_eps": False,
    "rope_theta": True,
    "compress_rope_theta": True,
    "rms_norm_eps": True,
}
_BOOLS = ("norm_topk_prob", "shared_expert_swiglu_limit", "tie_word_embeddings")
_STRS = ("scoring_func", "topk_method", "torch_dtype", "model_type")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_int(name: str, v, minimum: int) -> None:
    if not _is_int(v):
        raise ConfigError(f"{name}: expected an integer, got {v!r}")
    if v < minimum:
        raise ConfigError(f"{name}: must be >= {minimum}, got {v}")


def _check_float(name: str, v, positive: bool) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(f"{name}: expected a number, got {v!r}")
    if v < 0 or (positive and v == 0):
        raise ConfigError(f"{name}: must be {'> 0' if positive else '>= 0'}, got {v}")
    return float(v)


def _validate(c: DeepseekV4Config) -> None:
    # Types first, so the structural checks below compare numbers, never raise TypeError.
    for name, minimum in _INT_MIN.items():
        _check_int(name, getattr(c, name), minimum)
    for name, positive in _FLOAT_POSITIVE.items():
        # JSON writes 10000 for 1e4: store floats as float so arithmetic never truncates.
        object.__setattr__(c, name, _check_float(name, getattr(c, name), positive))
    for name in _BOOLS:
        if not isinstance(getattr(c, name), bool):
            raise ConfigError(f"{name}: expected true or false, got {getattr(c, name)!r}")
    for name in _STRS:
        if not isinstance(getattr(c, name), str):
            raise ConfigError(f"{name}: expected a string, got {getattr(c, name)!r}")
    for name in ("rope_scaling", "quantization_config"):
        if getattr(c, name) is not None and not isinstance(getattr(c, name), dict):
            raise ConfigError(f"{name}: expected an object or null, got {getattr(c, name)!r}")
    if c.expert_dtype is not None and not isinstance(c.expert_dtype, str):
        raise ConfigError(f"expert_dtype: expected a string or null, got {c.expert_dtype!r}")
    _validate_quantization(c)
    if not isinstance(c.architectures, list) or not all(isinstance(a, str) for a in c.architectures):
        raise ConfigError(f"architectures: expected a list of strings, got {c.architectures!r}")
    if not isinstance(c.extra, dict):
        raise ConfigError(f"extra: expected a dict, got {type(c.extra).__name__}")

    if c.num_key_value_heads != 1:
        raise ConfigError(f"num_key_value_heads: DeepSeek-V4 has one shared KV head, got {c.num_key_value_heads}")
    if c.qk_rope_head_dim % 2:
        raise ConfigError(f"qk_rope_head_dim: must be even (RoPE rotates pairs), got {c.qk_rope_head_dim}")
    if c.head_dim <= c.qk_rope_head_dim:
        raise ConfigError(f"head_dim: must exceed qk_rope_head_dim ({c.qk_rope_head_dim}), got {c.head_dim}")
    if c.num_attention_heads % c.o_groups:
        raise ConfigError(
            f"o_groups: num_attention_heads ({c.num_attention_heads}) must be divisible by o_groups ({c.o_groups})"
        )
    if c.num_experts_per_tok > c.n_routed_experts:
        raise ConfigError(
            f"num_experts_per_tok: {c.num_experts_per_tok} exceeds n_routed_experts ({c.n_routed_experts})"
        )
    if c.num_hash_layers > c.num_hidden_layers:
        raise ConfigError(f"num_hash_layers: {c.num_hash_layers} exceeds num_hidden_layers ({c.num_hidden_layers})")
    if c.scoring_func not in SCORING_FUNCS:
        raise ConfigError(f"scoring_func: must be one of {', '.join(SCORING_FUNCS)}, got {c.scoring_func!r}")
    # The router implements exactly these (the release's values); anything else would be
    # parsed and then silently ignored.
    if c.topk_method != "noaux_tc":
        raise ConfigError(f"topk_method: only 'noaux_tc' (bias-selected top-k) is supported, got {c.topk_method!r}")
    if not c.norm_topk_prob:
        raise ConfigError("norm_topk_prob: only true is supported (routing weights are normalised over the top-k)")

    ratios = c.compress_ratios
    if not isinstance(ratios, list) or not all(_is_int(r) and r in COMPRESS_RATIOS for r in ratios):
        raise ConfigError(f"compress_ratios: expected a list of values in {COMPRESS_RATIOS}, got {ratios!r}")
    if len(ratios) not in (c.num_hidden_layers, c.num_layers_with_mtp):
        raise ConfigError(
            f"compress_ratios: has {len(ratios)} entries, expected num_hidden_layers ({c.num_hidden_layers})"
            f" or num_hidden_layers + num_nextn_predict_layers ({c.num_layers_with_mtp})"
        )
    if 4 in ratios:
        if c.index_topk < 1:
            raise ConfigError(f"index_topk: must be >= 1 when a layer has compress ratio 4, got {c.index_topk}")
        if c.index_head_dim <= c.qk_rope_head_dim:
            raise ConfigError(
                f"index_head_dim: must exceed qk_rope_head_dim ({c.qk_rope_head_dim}), got {c.index_head_dim}"
            )

    if c.rope_scaling is not None:
        kind = c.rope_scaling.get("type", c.rope_scaling.get("rope_type"))
        if kind != "yarn":
            raise ConfigError(f"rope_scaling: type must be 'yarn', got {kind!r}")
        for key in _YARN_KEYS:
            if key not in c.rope_scaling:
                raise ConfigError(f"rope_scaling: missing {key!r}")
            _check_float(f"rope_scaling: {key}", c.rope_scaling[key], positive=key != "beta_slow")

    eos = c.eos_token_id if isinstance(c.eos_token_id, list) else [c.eos_token_id]
    if not eos or not all(_is_int(t) and t >= 0 for t in eos):
        raise ConfigError(f"eos_token_id: expected a token id or a list of them, got {c.eos_token_id!r}")
    if max(c.bos_token_id, *eos) >= c.vocab_size:
        raise ConfigError(f"vocab_size: {c.vocab_size} must exceed every bos/eos token id (max {max(c.bos_token_id, *eos)})")


# The release's quantization_config: each key with the values this runtime implements.
_QUANT_KEYS = {"quant_method": ("fp8",), "fmt": ("e4m3",), "activation_scheme": ("dynamic",),
               "scale_fmt": ("ue8m0", None)}
FP8_BLOCK = 128  # weight blocks are 128x128; activations are quantized per 128 along K
FP4_BLOCK = 32  # one ue8m0 scale per 32 FP4 expert inputs
EXPERT_DTYPES = (None, "bf16", "bfloat16", "fp4")


def _validate_quantization(c: DeepseekV4Config) -> None:
    """The release format, and nothing that would parse but then be applied differently."""
    q = c.quantization_config
    if c.expert_dtype not in EXPERT_DTYPES:
        raise ConfigError(f"expert_dtype: must be one of {EXPERT_DTYPES}, got {c.expert_dtype!r}")
    if q is not None:
        if "quant_method" not in q:
            raise ConfigError("quantization_config: missing 'quant_method' (the release uses 'fp8')")
        for key, allowed in _QUANT_KEYS.items():
            v = q.get(key, allowed[-1] if None in allowed else allowed[0])
            if v not in allowed:
                shown = ", ".join(repr(a) for a in allowed if a is not None)
                raise ConfigError(f"quantization_config: {key} {v!r} is not supported (supported: {shown}"
                                  f"{'; absent means fp32 scales' if None in allowed else ''})")
        block = q.get("weight_block_size", [FP8_BLOCK, FP8_BLOCK])
        if list(block) != [FP8_BLOCK, FP8_BLOCK]:
            raise ConfigError(f"quantization_config: weight_block_size must be [128, 128], got {block!r}")
    # Activations are quantized per 128 along K of every FP8/FP4 GEMM (release numerics), and
    # FP4 rows carry one scale per 32 inputs: the inner dims must be whole blocks.
    inner = {}
    if q is not None:
        inner.update(hidden_size=c.hidden_size, q_lora_rank=c.q_lora_rank, moe_intermediate_size=c.moe_intermediate_size,
                     **{"o_groups * o_lora_rank": c.o_groups * c.o_lora_rank})
    if c.expert_dtype == "fp4":
        inner.update(hidden_size=c.hidden_size, moe_intermediate_size=c.moe_intermediate_size)
    for name, v in inner.items():
        if v % FP8_BLOCK:
            raise ConfigError(f"{name}: must be a multiple of {FP8_BLOCK} for release-format weights, got {v}")


# ---- layer slices and size ------------------------------------------------------------------


def with_num_layers(c: DeepseekV4Config, num_layers: int) -> DeepseekV4Config:
    """The same model with its first `num_layers` layers: every dim, the compress-ratio pattern
    and the hash layers among them kept, MTP entries of compress_ratios kept last. For when the
    whole model does not fit on the devices at hand (--num-layers)."""
    if not _is_int(num_layers) or not 1 <= num_layers <= c.num_hidden_layers:
        raise ConfigError(f"num_hidden_layers: --num-layers must be in [1, {c.num_hidden_layers}], got {num_layers!r}")
    if num_layers == c.num_hidden_layers:
        return c
    mtp = c.compress_ratios[c.num_hidden_layers:]
    return dataclasses.replace(c, num_hidden_layers=num_layers, compress_ratios=c.compress_ratios[:num_layers] + mtp,
                               num_hash_layers=min(c.num_hash_layers, num_layers), extra=dict(c.extra))


def with_mtp_modules(c: DeepseekV4Config, num_modules: int) -> DeepseekV4Config:
    """The same model with only its first `num_modules` MTP modules: those speculative decoding
    runs (none without it), so the weights, caches and plan of the others are never held.
    A checkpoint's tensors of the modules dropped here are skipped at load."""
    if not _is_int(num_modules) or not 0 <= num_modules <= c.num_mtp_layers:
        raise ConfigError(f"num_nextn_predict_layers: MTP modules to keep must be in [0, {c.num_mtp_layers}], "
                          f"got {num_modules!r}")
    if num_modules == c.num_mtp_layers:
        return c
    return dataclasses.replace(c, num_nextn_predict_layers=num_modules,
                               compress_ratios=c.compress_ratios[:c.num_hidden_layers + num_modules],
                               extra=dict(c.extra))


def estimate_num_parameters(c: DeepseekV4Config) -> int:
    """Parameters (tensor elements) of the checkpoint's main layers; MTP layers excluded."""
    d, hc, H, hd = c.hidden_size, c.hc_mult, c.num_attention_heads, c.head_dim
    hc_mix = (2 + hc) * hc  # pre (hc) + post (hc) + comb (hc*hc) mixing logits

    def compressor(ratio: int, dim: int) -> int:
        coff = 2 if ratio == 4 else 1  # ratio 4 pools overlapping blocks: two channel halves
        return 2 * coff * dim * d + ratio * coff * dim + dim

    total = c.vocab_size * d + d + (hc * hc * d + hc + 1)  # embed, final norm, hc_head
    if not c.tie_word_embeddings:
        total += c.vocab_size * d
    for layer_id in range(c.num_hidden_layers):
        ratio = c.layer_compress_ratio(layer_id)
        total += 2 * d + 2 * (hc_mix * hc * d + hc_mix + 3)  # norms and hc_{attn,ffn}
        total += c.q_lora_rank * d + c.q_lora_rank + H * hd * c.q_lora_rank  # wq_a, q_norm, wq_b
        total += hd * d + hd + H  # wkv, kv_norm, attn_sink
        total += c.o_groups * c.o_lora_rank * (H * hd // c.o_groups) + d * c.o_groups * c.o_lora_rank
        if ratio:
            total += compressor(ratio, hd)
        if ratio == 4:
            nI, dI = c.index_n_heads, c.index_head_dim
            total += nI * dI * c.q_lora_rank + nI * d + compressor(4, dI)
        E, inter = c.n_routed_experts, c.moe_intermediate_size
        total += E * d  # gate weight; hash layers keep it for the routing weights
        total += c.vocab_size * c.num_experts_per_tok if c.is_hash_layer(layer_id) else E  # tid2eid | bias
        total += (E + c.n_shared_experts) * 3 * inter * d
    return total
