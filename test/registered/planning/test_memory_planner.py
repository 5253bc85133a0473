"""Memory planner arithmetic against the real DeepSeek-V4 configs: DeepSeek-V4-Flash needs
2 x H200 in its release format, Pro 8 or more; sizes match the model and the pools as built;
a plan that does not fit names the shortfall and the flag."""

import dataclasses

import pytest
import torch

from sglang.srt.configs.deepseek_v4 import estimate_num_parameters
from sglang.srt.configs.loader import load_model_config
from sglang.srt.configs.presets import get_preset
from sglang.srt.planning.memory_planner import (
    GiB,
    H200_USABLE_BYTES,
    MemoryPlanError,
    PlanSettings,
    check_weights_fit,
    kv_bytes_per_token,
    load_transient_bytes,
    loaded_weight_format,
    min_gpus_to_fit,
    per_request_state_bytes,
    plan_memory,
    segment_activation_bytes,
    weight_bytes,
)

# The defaults of a CUDA server with breakable graphs on, at a 64K context.
SERVING = PlanSettings(weight_format="release", quant_numerics="release", kv_cache_dtype="auto", dp_size=1, page_size=128,
                       context_length=65536, max_running_requests=256, chunked_prefill_size=2048,
                       breakable_max_tokens=4096, decode_graph_max_bs=256, mem_fraction_static=0.8, max_total_tokens=None,
                       moe_backend="triton")
# A lean serving setup: the least a model can be served with usefully. The static fraction leaves
# the MoE's working set room: at Pro's 8 ranks a 1024-token step gathers 8192 tokens, and the
# MoE kernels hold an fp32 partial output per (token, expert) pair (28 KiB at Pro's width).
LEAN = dataclasses.replace(SERVING, context_length=8192, max_running_requests=32, breakable_max_tokens=1024,
                           chunked_prefill_size=1024, decode_graph_max_bs=32, mem_fraction_static=0.96)


def pro_like():
    """DeepSeek-V4-Pro's dims, built in code so these tests run without the reference data."""
    flash = get_preset("dsv4-flash")
    return dataclasses.replace(
        flash, hidden_size=7168, num_hidden_layers=61, num_attention_heads=128, q_lora_rank=1536, o_groups=16,
        n_routed_experts=384, moe_intermediate_size=3072, index_topk=1024,
        compress_ratios=[128, 128] + [4, 128] * 29 + [4] + [0], extra=dict(flash.extra))


@pytest.fixture(params=["release_config", "built_in_code"])
def pro(request):
    if request.param == "release_config":  # the repository's test/data/dsv4-reference
        return load_model_config(str(request.getfixturevalue("dsv4_reference_dir") / "DeepSeek-V4-Pro.config.json"))
    return pro_like()


def test_pro_like_config_is_the_release_config(dsv4_reference_dir):
    real = load_model_config(str(dsv4_reference_dir / "DeepSeek-V4-Pro.config.json"))
    assert dataclasses.replace(pro_like(), extra=real.extra) == real


def test_flash_release_weights_are_about_160_gb():
    w = weight_bytes(get_preset("dsv4-flash"), "release")
    assert 155e9 < w.total < 166e9  # the release's ~160 GB
    assert 150e9 < w.routed_experts < 151e9  # 256 experts x 3 x 2048 x 4096 x 44 layers (MTP too) x 0.53 B
    assert w.per_gpu(2) == w.replicated + w.routed_experts // 2  # EP=2: half the experts each
    bf16 = weight_bytes(get_preset("dsv4-flash"), "bfloat16")
    assert 3.4 < bf16.total / w.total < 3.8  # ~570 GB in bf16


def test_bf16_weight_bytes_equal_the_model_tensors():
    from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM

    config = get_preset("dsv4-tiny")
    model = DeepseekV4ForCausalLM(config, torch.bfloat16)
    tensors = list(model.parameters()) + list(model.buffers())
    assert weight_bytes(config, "bfloat16").total == sum(t.numel() * t.element_size() for t in tensors)
    assert sum(t.numel() for t in tensors) == estimate_num_parameters(config)


@pytest.mark.parametrize("preset, dtype, numerics, kv_cache_dtype, key_bytes", [
    ("dsv4-tiny", "bfloat16", "weight_only", "auto", 64),  # bf16 model: bf16 indexer keys (dim 32)
    ("dsv4-mini", "bfloat16", "weight_only", "fp8_e4m3", 256),
    ("dsv4-flash-slice-fp8", "bfloat16", "release", "fp8_e4m3", 68),  # packed FP4 keys (dim 128)
    ("dsv4-flash-slice-fp8", "bfloat16", "weight_only", "auto", 256),
    ("dsv4-tiny-fp8", "float32", "release", "auto", 68),
])
@pytest.mark.parametrize("chunk, breakable", [(256, 0), (64, 512), (-1, 0)])
def test_the_planner_counts_the_pool_as_built(preset, dtype, numerics, kv_cache_dtype, key_bytes, chunk, breakable):
    """The planner's count of the pool the model runner builds is the pool's nbytes(), byte for
    byte: compressed entries and indexer keys per token of context (plus the padding page),
    compressor and raw window rings per request slot, and the staging rows of the largest step
    those settings allow (no chunking: the context length)."""
    from sglang.srt.mem_cache.dsv4_kv_pool import DSV4KVPool
    from sglang.srt.planning.memory_planner import kv_pool_bytes, kv_rows_bytes, raw_window_plan_bytes, step_tokens

    config = get_preset(preset)
    s = dataclasses.replace(SERVING, weight_format=loaded_weight_format(config, dtype), model_dtype=dtype,
                            quant_numerics=numerics, kv_cache_dtype=kv_cache_dtype, max_running_requests=3,
                            context_length=1024, chunked_prefill_size=chunk if chunk > 0 else 1024,
                            breakable_max_tokens=breakable)
    kv_tokens = 128 * 16
    release = numerics == "release" and config.is_quantized
    # as ModelRunner builds it: the tokens plus the padding page, one ring row per request + 1
    pool = DSV4KVPool(config, kv_tokens + 128, 3, getattr(torch, dtype), "cpu", kv_cache_dtype=kv_cache_dtype,
                      round_nope_fp8=release, index_keys_fp4=release, max_step_tokens=step_tokens(s))
    assert pool.staging_rows == max(chunk if chunk > 0 else 1024, breakable)
    assert pool.indexer_keys[next(iter(pool.indexer_keys))][0].nbytes == key_bytes
    assert pool.nbytes() == kv_pool_bytes(config, s, kv_tokens)
    rings = sum(t.nbytes for st in [*pool.compressor_state.values(), *pool.indexer_state.values()]
                for t in (st.kv, st.score))
    raw = sum(t.nbytes for t in pool.raw)
    # raw KV: a window ring per request slot and one step's staging rows, on every layer
    assert raw == raw_window_plan_bytes(config, s) == config.num_hidden_layers * (
        3 * config.sliding_window + pool.staging_rows) * pool.raw[0][0].nbytes
    assert pool.nbytes() - rings - raw == kv_rows_bytes(config, s, kv_tokens)
    assert rings == 4 * per_request_state_bytes(config, 0)  # context 0: no page-table row
    assert kv_rows_bytes(config, s, kv_tokens) <= (kv_tokens + 128) * kv_bytes_per_token(
        config, kv_cache_dtype, dtype, release) < kv_rows_bytes(config, s, kv_tokens) + kv_tokens + 128


def test_a_plan_counts_its_pool_exactly():
    mini = get_preset("dsv4-flash-slice-fp8")
    s = dataclasses.replace(SERVING, context_length=8192, max_running_requests=16, breakable_max_tokens=0,
                            decode_graph_max_bs=0, kv_cache_dtype="fp8_e4m3")
    plan = plan_memory(mini, s, 40 * GiB)
    from sglang.srt.planning.memory_planner import kv_rows_bytes, raw_window_plan_bytes

    assert plan.kv_pool == kv_rows_bytes(mini, s, plan.kv_pool_tokens)
    assert plan.raw_window == raw_window_plan_bytes(mini, s)
    parts = plan.weights + plan.per_request_state + plan.raw_window + plan.rope_tables + plan.kv_pool + plan.graph_pool
    assert parts + plan.activation_reserve + plan.headroom == 40 * GiB


def test_flash_raw_kv_costs_a_ring_per_request_not_bytes_per_token():
    """DeepSeek-V4-Flash with an FP8 KV cache: a token of context costs its compressed entries
    and indexer keys only (3514.25 B with the release's packed FP4 keys, 4501.25 B with bf16
    keys; a raw row per token on every layer would add 43 x 584 B), a request slot its 43
    window rings of 128 rows (3.07 MiB)."""
    from sglang.srt.mem_cache.dsv4_kv_pool import raw_ring_bytes_per_request

    flash = get_preset("dsv4-flash")
    # 21 c4 layers x (584 / 4 + 68 / 4) + 20 c128 layers x 584 / 128
    assert kv_bytes_per_token(flash, "fp8_e4m3", index_keys_fp4=True) == 3515  # the pool's 3514.25, whole bytes
    assert kv_bytes_per_token(flash, "fp8_e4m3") == 4502  # bf16 keys: 4501.25
    assert raw_ring_bytes_per_request(flash, torch.bfloat16, "fp8_e4m3") == 43 * 128 * 584
    plan = plan_memory(flash, dataclasses.replace(SERVING, dp_size=2, kv_cache_dtype="fp8_e4m3"), H200_USABLE_BYTES)
    assert plan.kv_bytes_per_token == 3515  # release weights and numerics: packed keys
    # 256 request slots' rings + 4096 staging rows (the largest breakable bucket) on 43 layers
    assert plan.raw_window == 43 * 584 * (256 * 128 + 4096)


def test_fp8_kv_entries_are_584_bytes():
    from dsv4_kernels.kv_fp8 import kv_row_bytes

    from sglang.srt.mem_cache.dsv4_kv_pool import DSV4KVPool

    # the planner counts the pool's rows: 448 e4m3 + 64 bf16 rope + 7 scales padded to 8
    assert kv_row_bytes(512, 64, "fp8_e4m3", torch.bfloat16) == 584
    assert kv_row_bytes(512, 64, "auto", torch.bfloat16) == 1024
    flash = get_preset("dsv4-flash")
    assert kv_bytes_per_token(flash, "fp8_e4m3") < 0.66 * kv_bytes_per_token(flash, "auto")  # bf16 index keys stay
    # and that count, rounded up to a whole byte, is what an FP8 pool holds per slot
    # (dsv4-mini: head 512 = 448 nope + 64 rope; 2/128 of a c128 row makes it fractional)
    mini, slots = get_preset("dsv4-mini"), 128 * 8
    pool = DSV4KVPool(mini, slots, 2, torch.bfloat16, "cpu", kv_cache_dtype="fp8_e4m3", max_step_tokens=16)
    kv = sum(t.numel() * t.element_size() for t in [*pool.compressed.values(), *pool.indexer_keys.values()])
    assert kv_bytes_per_token(mini, "fp8_e4m3") - 1 < kv / slots < kv_bytes_per_token(mini, "fp8_e4m3")


def test_flash_needs_two_h200():
    flash = get_preset("dsv4-flash")
    with pytest.raises(MemoryPlanError, match=r"weights need 1[45]\d\.\d GiB per GPU at --dp-size 1.*raise --dp-size"):
        plan_memory(flash, SERVING, H200_USABLE_BYTES)
    assert min_gpus_to_fit(flash, SERVING) == 2
    plan = plan_memory(flash, dataclasses.replace(SERVING, dp_size=2), H200_USABLE_BYTES)
    assert 75 * GiB < plan.weights < 90 * GiB  # ~77 GB of experts + the replicated part
    assert plan.kv_pool_tokens >= 65536 and plan.kv_pool_tokens % 128 == 0
    assert plan.headroom >= 0
    parts = plan.weights + plan.per_request_state + plan.raw_window + plan.rope_tables + plan.kv_pool + plan.graph_pool
    assert parts + plan.activation_reserve + plan.headroom == H200_USABLE_BYTES


def test_window_only_layers_keep_no_kv_per_token():
    # Flash's first two layers read only their window (per-request rings): no KV grows with the
    # tokens, so the pool is what the running requests could use, not a division by zero
    two = load_model_config("dsv4-flash", 2)
    assert [two.layer_compress_ratio(i) for i in range(2)] == [0, 0]
    plan = plan_memory(two, SERVING, H200_USABLE_BYTES)
    assert plan.kv_bytes_per_token == 0
    assert plan.kv_pool_tokens == SERVING.context_length * SERVING.max_running_requests


def test_humming_loading_holds_one_layer_s_gate_up_experts_once_more():
    flash = load_model_config("dsv4-flash", 20)
    humming = dataclasses.replace(SERVING, moe_backend="humming")
    # 256 experts' w1 | w3 [4096, 4096] FP4 (half a byte) with an e8m0 scale per 32
    one_layer = 256 * (2 * 2048 * 4096 // 2 + 2 * 2048 * 4096 // 32)
    assert load_transient_bytes(flash, humming) == one_layer
    assert load_transient_bytes(flash, dataclasses.replace(humming, dp_size=2)) == one_layer // 2  # a rank's experts
    assert load_transient_bytes(flash, SERVING) == 0  # the Triton backend reads the packed originals
    assert load_transient_bytes(flash, dataclasses.replace(humming, weight_format="bfloat16")) == 0
    # 20 Flash layers (73.4 GiB with the split compressor weights) fit 75 GiB with the Triton
    # backend, not with humming's re-layout
    weights = check_weights_fit(flash, SERVING, 75 * GiB)
    assert 73 * GiB < weights < 73.5 * GiB
    with pytest.raises(MemoryPlanError, match=r"weights need 73\.4 GiB per GPU at --dp-size 1 plus 2\.1 GiB while "
                                              r"the humming MoE backend re-lays out one layer's experts, 75\.0 GiB is "
                                              r"free: short by 0\.6 GiB.*--num-layers"):
        check_weights_fit(flash, humming, 75 * GiB)
    with pytest.raises(MemoryPlanError, match="while the humming MoE backend"):
        plan_memory(flash, humming, 75 * GiB)


def test_pro_needs_eight_or_more(pro):
    assert pro.num_hidden_layers == 61 and pro.n_routed_experts == 384
    # Four GPUs cannot even hold the weights; eight can, leanly served.
    with pytest.raises(MemoryPlanError, match=r"weights need 2\d\d\.\d GiB per GPU at --dp-size 4"):
        plan_memory(pro, dataclasses.replace(SERVING, dp_size=4), H200_USABLE_BYTES)
    assert min_gpus_to_fit(pro, LEAN) == 8
    # At the default static fraction (0.8) the weights alone (128 GiB per GPU) exceed it at 8.
    with pytest.raises(MemoryPlanError, match=r"not enough memory for the KV cache: .*\(weights 12\d\.\d"):
        plan_memory(pro, dataclasses.replace(SERVING, dp_size=8), H200_USABLE_BYTES)
    assert min_gpus_to_fit(get_preset("dsv4-flash"), LEAN) == 2


def test_a_plan_that_does_not_fit_names_the_flag():
    flash = get_preset("dsv4-flash")
    two = dataclasses.replace(SERVING, dp_size=2)
    with pytest.raises(MemoryPlanError, match=r"--max-total-tokens 40000000 needs .* short by .* GiB"):
        plan_memory(flash, dataclasses.replace(two, max_total_tokens=40_000_000), H200_USABLE_BYTES)
    with pytest.raises(MemoryPlanError, match=r"not enough memory for the KV cache: .* short by .*--context-length"):
        plan_memory(flash, dataclasses.replace(two, context_length=1048576, mem_fraction_static=0.65),
                    H200_USABLE_BYTES)
    with pytest.raises(MemoryPlanError, match=r"graph pool .* short by .* lower --mem-fraction-static"):
        plan_memory(flash, dataclasses.replace(two, mem_fraction_static=0.99), H200_USABLE_BYTES)


def test_kv_pool_follows_the_static_fraction_and_is_capped_by_use():
    mini = get_preset("dsv4-mini")
    # 64 requests of 64K context: more KV than 4 GiB holds (a token of context costs 977 B)
    s = dataclasses.replace(SERVING, weight_format="bfloat16", context_length=65536, max_running_requests=64,
                            breakable_max_tokens=0, decode_graph_max_bs=0)
    small = plan_memory(mini, dataclasses.replace(s, mem_fraction_static=0.5), 4 * GiB)
    big = plan_memory(mini, dataclasses.replace(s, mem_fraction_static=0.8), 4 * GiB)
    assert 0 < small.kv_pool_tokens < big.kv_pool_tokens
    per_token = kv_bytes_per_token(mini, "auto")
    padding_page = 128 * per_token  # the pool's page 0, held beside the tokens
    assert big.kv_pool_tokens == (int(4 * GiB * 0.8) - big.weights - big.per_request_state - big.raw_window
                                  - big.rope_tables - padding_page) // per_token // 128 * 128
    huge = plan_memory(mini, s, 139 * GiB)
    assert huge.kv_pool_tokens == 65536 * 64  # never more than the running requests can use


def test_breakable_graph_pool_does_not_grow_with_the_context_length():
    flash = get_preset("dsv4-flash")
    # One 1M-token request: with bf16 KV (every raw token kept) it alone needs ~50 GiB; FP8 fits.
    breakable_only = dataclasses.replace(SERVING, dp_size=2, decode_graph_max_bs=0, max_running_requests=8,
                                   kv_cache_dtype="fp8_e4m3", mem_fraction_static=0.9)
    short = plan_memory(flash, dataclasses.replace(breakable_only, context_length=8192), H200_USABLE_BYTES)
    long = plan_memory(flash, dataclasses.replace(breakable_only, context_length=1048576), H200_USABLE_BYTES)
    assert short.graph_pool == long.graph_pool < 4 * GiB
    # The eager break reads its candidates through the page table: what grows with the context
    # is only the indexer's top-k chunk, bounded by its workspace (before: 4096 x 1M/4 int32
    # candidate slots, 4 GiB more at 1M).
    from sglang.srt.layers.attention.dsv4.widths import INDEXER_WORKSPACE_BYTES

    assert 0 < long.activation_reserve - short.activation_reserve <= INDEXER_WORKSPACE_BYTES


def test_moe_working_set_counts_the_fp32_partial_of_every_pair():
    flash = get_preset("dsv4-flash")
    topk, d, inter = flash.num_experts_per_tok, flash.hidden_size, flash.moe_intermediate_size
    # 8192 tokens per rank at DP 2: the MoE sees both ranks' 16384 tokens, and its working set
    # (2.5 GiB) is the largest term (attention's: 8192 x 64 heads x 512 x 8 B + the indexer's
    # q, 2.1 GiB): the gathered input and fp32 outputs, and per (token, expert) pair the bf16
    # activation h and the fp32 partial the kernels write
    n, gathered = 8192, 2 * 8192
    moe = gathered * d * (2 + 4 + 4) + gathered * topk * (inter * 2 + d * 4)
    attn = n * flash.num_attention_heads * flash.head_dim * 8 + n * flash.index_n_heads * (flash.index_head_dim * 2 + 4)
    assert moe > attn
    residual, logits = 3 * n * flash.hc_mult * d * 4, flash.vocab_size * 4 * 2
    assert segment_activation_bytes(flash, n, 2, 1) == moe + residual + logits
