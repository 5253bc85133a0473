"""Packed FP4 indexer keys in the runtime (release numerics): the pool stores them as 68-byte
rows at index_head_dim 128, and the model selects the very same top-k entries, with the very
same logits, as with keys in the model dtype holding the same rounded values."""

import sys
from pathlib import Path

import pytest
import torch
from dsv4_kernels import quant_reference as Q

from sglang.srt.configs.presets import get_preset
from sglang.srt.layers.attention import deepseek_v4_backend
from sglang.srt.mem_cache.dsv4_kv_pool import DSV4KVPool, kv_bytes_per_token
from sglang.srt.model_executor import model_runner as model_runner_module
from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.test.runner_args import cpu_server_args

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from dsv4_harness import Session, run_step  # noqa: E402


def test_release_pool_packs_indexer_keys_and_a_bf16_pool_does_not():
    cfg = get_preset("dsv4-tiny-fp8")  # index_head_dim 128, c4 layers 1 and 3
    packed = DSV4KVPool(cfg, 1024, 2, torch.bfloat16, "cpu", index_keys_fp4=True, max_step_tokens=16)
    assert {k: (v.dtype, tuple(v.shape)) for k, v in packed.indexer_keys.items()} == {
        1: (torch.uint8, (256, 68)), 3: (torch.uint8, (256, 68))}
    assert packed.decode_index_keys(packed.indexer_keys[1]).abs().max() == 0  # fresh rows read as zeros
    plain = DSV4KVPool(cfg, 1024, 2, torch.bfloat16, "cpu", max_step_tokens=16)
    assert plain.index_key_layout is None and plain.indexer_keys[1].dtype == torch.bfloat16
    assert plain.nbytes() - packed.nbytes() == 2 * 256 * (256 - 68)
    assert kv_bytes_per_token(cfg, torch.bfloat16) - kv_bytes_per_token(cfg, torch.bfloat16, index_keys_fp4=True) \
        == 2 * (256 - 68) / 4
    with pytest.raises(ValueError, match="index_head_dim 48 must be a positive multiple of 32"):
        DSV4KVPool(get_preset("dsv4-tiny").__class__(**{**get_preset("dsv4-tiny").__dict__, "index_head_dim": 48}),
                   256, 2, torch.float32, "cpu", index_keys_fp4=True, max_step_tokens=16)


class _ModelDtypeKeysPool(DSV4KVPool):
    """A release-numerics pool whose indexer keys stay in the model dtype (the rounding in the
    indexer still runs: they hold the same rounded values as packed keys)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **{**kwargs, "index_keys_fp4": False})


def _run(monkeypatch, model_dtype_keys: bool, segment_kernels: str):
    """dsv4-tiny-fp8 in release numerics (fp32, CPU): two requests, prefill in chunks, then
    decode steps; every indexer top-k the attention break selects, every step's logits."""
    if model_dtype_keys:
        monkeypatch.setattr(model_runner_module, "DSV4KVPool", _ModelDtypeKeysPool)
    selected = []

    def recording_select_topk(config, q, w, key_pool, im, cands, num_tokens, kernels=None):
        real_select_topk(config, q, w, key_pool, im, cands, num_tokens, kernels)
        selected.append(im.topk_slots[:num_tokens].clone())

    real_select_topk = deepseek_v4_backend.select_topk
    monkeypatch.setattr(deepseek_v4_backend, "select_topk", recording_select_topk)
    runner = ModelRunner(cpu_server_args(model_path="dsv4-tiny-fp8", context_length=512, max_total_tokens=2048,
                                         max_running_requests=2, segment_kernels=segment_kernels))
    assert runner.server_args.quant_numerics == "release"
    ids = torch.randint(3, 500, (2, 300), generator=torch.Generator().manual_seed(11)).tolist()
    a, b = Session(runner), Session(runner)
    logits = [run_step(runner, [a], [ids[0][:170]]).next_token_logits,
              run_step(runner, [a, b], [ids[0][170:230], ids[1][:200]]).next_token_logits]
    for k in range(6):  # decode both, through c4 block ends
        logits.append(run_step(runner, [a, b], [[ids[0][230 + k]], [ids[1][200 + k]]]).next_token_logits)
    monkeypatch.undo()
    return runner, selected, logits


@pytest.mark.parametrize("segment_kernels", ["off", "on"])
def test_packed_keys_select_the_same_topk_as_model_dtype_keys(monkeypatch, segment_kernels):
    """With segment kernels on (dsv4_kernels ops; their torch references on CPU) the key write
    goes through ops.store_index_keys_fp4, off through the model's torch code."""
    packed, sel_packed, logits_packed = _run(monkeypatch, False, segment_kernels)
    plain, sel_plain, logits_plain = _run(monkeypatch, True, segment_kernels)
    assert packed.kv_pool.index_key_layout is not None and plain.kv_pool.index_key_layout is None
    for layer, pool in packed.kv_pool.indexer_keys.items():
        assert pool.dtype == torch.uint8 and pool.shape[1] == 68
        keys = plain.kv_pool.indexer_keys[layer]
        assert keys.dtype == torch.float32 and keys.abs().sum() > 0
        # the same cached values; model-dtype keys are FP4-rounded per 32 already
        assert torch.equal(packed.kv_pool.decode_index_keys(pool), keys)
        assert torch.equal(Q.fp4_round_blocks(keys), keys)
    assert len(sel_packed) == len(sel_plain) == 2 * 8  # two c4 layers, 8 steps
    for got, want in zip(sel_packed, sel_plain):
        assert torch.equal(got, want)
    # the top-k (4 of up to 58 entries) really chose: full selections that differ between tokens
    last = sel_packed[-1]
    assert (last >= 0).sum(-1).tolist() == [4, 4] and not torch.equal(last[0].sort().values, last[1].sort().values)
    for got, want in zip(logits_packed, logits_plain):
        assert torch.equal(got, want)


def test_packed_keys_without_release_numerics_are_refused(monkeypatch):
    """Packed keys hold FP4-rounded values only: a weight-only run that was given a packed key
    pool fails with a clear error instead of rounding keys the reference does not round."""

    class PackedPool(DSV4KVPool):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "index_keys_fp4": True})

    monkeypatch.setattr(model_runner_module, "DSV4KVPool", PackedPool)
    runner = ModelRunner(cpu_server_args(model_path="dsv4-tiny-fp8", quant_numerics="weight_only", context_length=256,
                                         max_total_tokens=512, max_running_requests=1))
    with pytest.raises(ValueError, match="packed FP4 indexer keys hold FP4-rounded keys: they need release numerics"):
        run_step(runner, [Session(runner)], [list(range(3, 11))])
