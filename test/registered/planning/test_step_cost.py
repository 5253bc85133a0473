"""step_cost: the physical limit of a step from the real Flash config (arithmetic checked by hand)."""

import pytest

from sglang.srt.configs.loader import load_model_config
from sglang.srt.planning import step_cost as sc


@pytest.fixture(scope="module")
def flash():
    config = load_model_config("dsv4-flash")
    return config, sc.model_bytes(config)


def test_expected_experts_hit_runs_from_topk_to_all():
    assert sc.expected_experts_hit(256, 6, 1) == pytest.approx(6)
    assert sc.expected_experts_hit(256, 6, 2) == pytest.approx(256 * (1 - (250 / 256) ** 2))
    assert sc.expected_experts_hit(256, 6, 10_000) == pytest.approx(256)


def test_flash_expert_is_three_fp4_matrices_with_e8m0_scales(flash):
    _, mb = flash
    # gate, up [2048, 4096] and down [4096, 2048]: half a byte per weight + one scale byte per 32
    assert mb.expert_per_layer == 3 * 2048 * 4096 * 17 // 32
    assert mb.embed_row == 4096 * 2  # bf16 row, gathered per token


def test_flash_decode_bytes(flash):
    config, mb = flash
    one = sc.decode_step_cost(config, 1, 0, bytes_=mb)
    # batch 1, no context: the dense weights, one embedding row and 6 experts per layer
    assert one.weight_bytes == pytest.approx(mb.dense + mb.embed_row + 43 * 6 * mb.expert_per_layer)
    assert one.kv_bytes == 0
    # EP 2 at batch 1 per rank: two tokens' picks, half of them land on this rank's experts
    ep = sc.decode_step_cost(config, 1, 0, ep_size=2, bytes_=mb)
    hit = sc.expected_experts_hit(256, 6, 2) / 2
    assert ep.weight_bytes == pytest.approx(mb.dense + mb.embed_row + 43 * hit * mb.expert_per_layer)
    # at batch 64 on 2 ranks nearly every local expert is read: close to the rank's whole share
    big = sc.decode_step_cost(config, 64, 0, ep_size=2, bytes_=mb)
    assert 0.9 * 128 * 43 * mb.expert_per_layer < big.weight_bytes - mb.dense < 128 * 43 * mb.expert_per_layer + 64 * mb.embed_row
    assert big.seconds() == pytest.approx(big.total_bytes / 4.8e12)


def test_flash_kv_read_per_token_at_1024_context(flash):
    config, _ = flash
    row, key = 512 * 2, 128 * 2
    ratios = [config.layer_compress_ratio(i) for i in range(43)]
    want = 43 * 128 * row + ratios.count(4) * (256 * key + 256 * row) + ratios.count(128) * 8 * row
    assert sc.kv_read_bytes_per_token(config, 1024, row, key) == want


def test_flash_flops_per_token_layer_near_the_hand_count(flash):
    config, _ = flash
    # benchmark-history.md (122c9b3): about 0.66 GFLOP per token-layer (projections 0.23, 7 experts 0.35, attention 0.08)
    per_layer = sc.flops_per_token(config, 1024) / 43
    assert 0.55e9 < per_layer < 0.7e9
    # the attention core grows with the context, the matrices do not
    assert sc.flops_per_token(config, 65536) > sc.flops_per_token(config, 1024)


@pytest.mark.parametrize("name, want", [
    ("NVIDIA H200", "H200 SXM"), ("NVIDIA H200 NVL", "H200 NVL"), ("NVIDIA H100 80GB HBM3", "H100 SXM"),
    ("NVIDIA H100 PCIe", "H100 PCIe"), ("NVIDIA H100 NVL", "H100 NVL"),
])
def test_ceilings_follow_the_gpu_name(name, want):
    assert sc.ceilings_for(name).name == want


def test_a_gpu_without_known_peaks_has_no_ceilings():
    assert sc.ceilings_for("NVIDIA A100-SXM4-80GB") is None
    assert sc.ceilings_for(None) is None


def test_decode_bound_scales_with_the_gpus_bandwidth(flash):
    config, mb = flash
    cost = sc.decode_step_cost(config, 64, 1024, bytes_=mb)
    h100 = sc.ceilings_for("NVIDIA H100 80GB HBM3")
    assert cost.seconds(h100) == pytest.approx(cost.total_bytes / 3.35e12)
    assert cost.seconds(h100) / cost.seconds(sc.H200) == pytest.approx(4.8 / 3.35)
