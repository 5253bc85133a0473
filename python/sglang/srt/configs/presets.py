"""Built-in model shapes with random weights: tiny for CPU tests, mini for one GPU, a
four-layer slice of DeepSeek-V4-Flash for per-layer timings, and DeepSeek-V4-Flash itself; the
first three also in the release weight format (`<name>-fp8`: FP8 linears, FP4 experts), which
dsv4-flash always has. Each call returns a fresh config.

`python -m sglang.srt.configs.presets NAME --write-config DIR [--num-layers N]` writes a
release-style config.json for a preset.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Callable, Optional, Sequence

from sglang.srt.configs.deepseek_v4 import DeepseekV4Config, estimate_num_parameters, with_num_layers


def _preset(**dims) -> DeepseekV4Config:
    # What every preset shares with the released models: the block structure, not the sizes.
    rope_factor, original_max = dims.pop("rope_factor"), dims.pop("original_max_position_embeddings")
    dims["compress_ratios"] = list(dims["compress_ratios"])  # each config owns its list
    shared = dict(
        rope_scaling={
            "type": "yarn",
            "factor": rope_factor,
            "beta_fast": 32,
            "beta_slow": 1,
            "original_max_position_embeddings": original_max,
        },
        rope_theta=10000.0,
        compress_rope_theta=160000.0,
        hc_mult=4,
        hc_sinkhorn_iters=20,
        scoring_func="sqrtsoftplus",
        swiglu_limit=10.0,
        num_hash_layers=1,
        n_shared_experts=1,
        num_key_value_heads=1,
        bos_token_id=0,
        eos_token_id=1,
        torch_dtype="bfloat16",
        num_nextn_predict_layers=0,
    )
    return DeepseekV4Config(**(shared | dims))


# dsv4-tiny's dims: shared with dsv4-tiny-fp8, which widens them to whole quantization blocks.
_TINY_DIMS = dict(
    vocab_size=512,
    hidden_size=64,
    num_hidden_layers=4,
    compress_ratios=[0, 4, 128, 4],
    num_attention_heads=4,
    head_dim=64,
    qk_rope_head_dim=16,
    q_lora_rank=32,
    o_groups=2,
    o_lora_rank=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    routed_scaling_factor=1.5,
    sliding_window=8,
    index_n_heads=16,
    index_head_dim=32,
    index_topk=4,
    max_position_embeddings=4096,
    rope_factor=4,
    original_max_position_embeddings=256,
)


def dsv4_tiny() -> DeepseekV4Config:
    """CPU tests: every layer type in four layers, small enough to run in milliseconds."""
    return _preset(**_TINY_DIMS)


def dsv4_mini() -> DeepseekV4Config:
    """One GPU: the real head_dim, window and top-k, at a width that serves quickly."""
    return _preset(
        vocab_size=32768,
        hidden_size=1024,
        num_hidden_layers=8,
        compress_ratios=[0, 0, 4, 128, 4, 128, 4, 0],
        num_attention_heads=16,
        head_dim=512,
        qk_rope_head_dim=64,
        q_lora_rank=384,
        o_groups=4,
        o_lora_rank=256,
        n_routed_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=512,
        routed_scaling_factor=1.5,
        sliding_window=128,
        index_n_heads=16,
        index_head_dim=128,
        index_topk=256,
        max_position_embeddings=65536,
        rope_factor=16,
        original_max_position_embeddings=4096,
    )


def dsv4_flash_slice() -> DeepseekV4Config:
    """Per-layer timings of DeepSeek-V4-Flash: its exact layer dims, fewer layers and experts."""
    return _preset(
        vocab_size=129280,
        hidden_size=4096,
        num_hidden_layers=4,
        compress_ratios=[0, 4, 128, 4],
        num_attention_heads=64,
        head_dim=512,
        qk_rope_head_dim=64,
        q_lora_rank=1024,
        o_groups=8,
        o_lora_rank=1024,
        n_routed_experts=16,
        num_experts_per_tok=6,
        moe_intermediate_size=2048,
        routed_scaling_factor=1.5,
        sliding_window=128,
        index_n_heads=64,
        index_head_dim=128,
        index_topk=512,
        max_position_embeddings=65536,
        rope_factor=16,
        original_max_position_embeddings=65536,
    )


def dsv4_tiny_fp8_dims() -> DeepseekV4Config:
    """CPU tests of the release format: dsv4-tiny's structure at dims that are whole
    quantization blocks (the conformance-tiny-fp8fp4 model's dims), still bf16 here."""
    return _preset(**(_TINY_DIMS | dict(hidden_size=256, head_dim=128, qk_rope_head_dim=64, q_lora_rank=128,
                                        o_lora_rank=64, moe_intermediate_size=128, index_head_dim=128)))


# The release's quantization_config, as DeepSeek-V4's config.json has it.
RELEASE_QUANTIZATION = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                        "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}


def release_format(config: DeepseekV4Config) -> DeepseekV4Config:
    """The same model in the release's weight format: FP8 block-scaled linears, FP4 experts."""
    return dataclasses.replace(config, quantization_config=dict(RELEASE_QUANTIZATION), expert_dtype="fp4")


# config.json fields of the release this runtime does not read (kept in `extra`).
_RELEASE_EXTRA = {
    "attention_bias": False,
    "attention_dropout": 0.0,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "use_cache": True,
}


def dsv4_flash() -> DeepseekV4Config:
    """DeepSeek-V4-Flash (about 284 B parameters), in the release's weight format.

    Dims from DESIGN.md section 3; every other field follows DeepSeek-V4-Pro's config.json.
    Differences from Pro and why:
    - width: hidden 4096 (Pro 7168), 43 layers (61), 64 heads (128), q_lora 1024 (1536),
      o_groups 8 (16); o_lora 1024, head_dim 512 and qk_rope 64 as Pro;
    - experts: 256 routed (384), moe_intermediate 2048 (3072); top-6 and 1 shared as Pro;
    - indexer: top-512 (1024); 64 heads x 128 as Pro;
    - compress_ratios: `[0, 0] + [4, 128] * 20 + [4]` for the 43 layers (Pro starts with two
      ratio-128 layers, Flash with two window-only ones), then `0` for the MTP layer, which
      Pro also lists last (so 44 entries, as Pro has 61 + 1).
    Not given for Flash, so Pro's values are taken: num_hash_layers 3, routed_scaling_factor
    2.5, swiglu_limit 10, num_nextn_predict_layers 1, 1 M context (max_position_embeddings
    1048576) with Pro's YaRN (factor 16 over 65536, beta 32/1), rope_theta 1e4,
    compress_rope_theta 1.6e5, mHC 4 x 20 Sinkhorn iterations, eps 1e-6, vocab 129280 and its
    bos/eos ids, the fp8 e4m3 / ue8m0 [128, 128] quantization_config and `expert_dtype: fp4`.
    The weights are random (`--load-format dummy`): built quantized on the device, tensor by
    tensor and only this DP rank's experts (model_loader/random_init.py), as the release's
    checkpoint would be loaded.
    """
    return _preset(
        vocab_size=129280,
        hidden_size=4096,
        num_hidden_layers=43,
        compress_ratios=[0, 0] + [4, 128] * 20 + [4] + [0],  # 43 layers, then the MTP layer
        num_attention_heads=64,
        head_dim=512,
        qk_rope_head_dim=64,
        q_lora_rank=1024,
        o_groups=8,
        o_lora_rank=1024,
        n_routed_experts=256,
        num_experts_per_tok=6,
        n_shared_experts=1,
        moe_intermediate_size=2048,
        routed_scaling_factor=2.5,
        num_hash_layers=3,
        sliding_window=128,
        index_n_heads=64,
        index_head_dim=128,
        index_topk=512,
        max_position_embeddings=1048576,
        rope_factor=16,
        original_max_position_embeddings=65536,
        num_nextn_predict_layers=1,
        expert_dtype="fp4",
        quantization_config=dict(RELEASE_QUANTIZATION),
        extra=dict(_RELEASE_EXTRA),
    )


PRESETS: dict[str, Callable[[], DeepseekV4Config]] = {
    "dsv4-tiny": dsv4_tiny,
    "dsv4-mini": dsv4_mini,
    "dsv4-flash-slice": dsv4_flash_slice,
    "dsv4-flash": dsv4_flash,
    # Release-format variants (`-fp8`): --load-format dummy builds them quantized on the device.
    "dsv4-tiny-fp8": lambda: release_format(dsv4_tiny_fp8_dims()),
    "dsv4-mini-fp8": lambda: release_format(dsv4_mini()),
    "dsv4-flash-slice-fp8": lambda: release_format(dsv4_flash_slice()),
}


def get_preset(name: str) -> DeepseekV4Config:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    return PRESETS[name]()


def write_config(config: DeepseekV4Config, directory: str) -> str:
    """Write `config` as DIR/config.json (Hugging Face names, sorted keys); returns the path."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "config.json")
    with open(path, "w") as f:
        json.dump(config.to_dict(), f, indent=2, sort_keys=True)
        f.write("\n")
    return path


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m sglang.srt.configs.presets",
                                     description="Print a preset's size or write its config.json")
    parser.add_argument("preset", choices=list(PRESETS), help="the preset's name")
    parser.add_argument("--write-config", metavar="DIR", help="write DIR/config.json")
    parser.add_argument("--num-layers", type=int, help="keep only the first N layers")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = make_parser().parse_args(argv)
    config = get_preset(args.preset)
    if args.num_layers is not None:
        config = with_num_layers(config, args.num_layers)
    print(f"{args.preset}: {config.num_hidden_layers} layers, {estimate_num_parameters(config) / 1e9:.1f} B parameters")
    if args.write_config:
        print(f"wrote {write_config(config, args.write_config)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
