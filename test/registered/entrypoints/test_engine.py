"""Offline Engine on dsv4-tiny (CPU, random weights): greedy generation, meta counts, and
greedy output that does not depend on batch neighbours, chunking or mixed chunk."""

import pytest

from sglang.srt.entrypoints.engine import Engine
from sglang.test.kv_accounting import assert_stats_no_request_holds_kv

GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
PROMPTS = [
    "The quick brown fox jumps over the lazy dog, and then it runs away into the forest.",
    "Hello",
    "DeepSeek-V4 mixes a sliding window with compressed KV entries.",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
    "Once upon a time",
    "Breakable CUDA graphs capture everything except the attention core.",
    "a" * 70,
    "Zürich, 東京, and São Paulo",
]


@pytest.fixture(scope="module")
def engine():
    e = Engine(model_path="dsv4-tiny", device="cpu", chunked_prefill_size=-1, max_running_requests=8,
               context_length=512)
    yield e
    e.shutdown()


@pytest.fixture(scope="module")
def batch_outputs(engine):
    """Greedy outputs of all PROMPTS served together, unchunked and not mixed."""
    return _outputs(engine)


def _outputs(engine, prompts=PROMPTS):
    return [r["output_ids"] for r in engine.generate(prompts, GREEDY)]


def test_greedy_generation_reports_text_ids_and_meta(engine):
    res = engine.generate(PROMPTS[0], GREEDY)
    assert len(res["output_ids"]) == 8
    assert res["meta_info"] == {
        "prompt_tokens": len(engine.tokenizer.encode(PROMPTS[0])),
        "completion_tokens": 8,
        "cached_tokens": 0,  # prefix caching is off by default
        "finish_reason": {"type": "length", "length": 8},
    }
    assert isinstance(res["text"], str)
    assert res["text"] == engine.tokenizer.decode(res["output_ids"])
    again = engine.generate(input_ids=engine.tokenizer.encode(PROMPTS[0]), sampling_params=GREEDY)
    assert again["output_ids"] == res["output_ids"]


def test_greedy_output_is_the_same_alone_and_in_a_batch_of_eight(engine, batch_outputs):
    alone = [engine.generate(p, GREEDY)["output_ids"] for p in PROMPTS]
    assert batch_outputs == alone


def test_max_new_tokens_zero_and_bad_params(engine):
    res = engine.generate("Hi", {"max_new_tokens": 0})
    assert res["output_ids"] == [] and res["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        engine.generate(["ok", "bad"], [GREEDY, {"temperature": -1}])
    info = engine.get_server_info()
    assert info["num_waiting_reqs"] == info["num_running_reqs"] == 0
    assert_stats_no_request_holds_kv(info)
    assert info["server_args"]["model_path"] == "dsv4-tiny" and info["forward_eager"] > 0
    # prefix caching is on without a flag, as it is in SGLang
    assert info["server_args"]["enable_prefix_caching"] is True and info["prefix_caching"] is True


def test_chunked_prefill_matches_unchunked(batch_outputs):
    chunked = Engine(model_path="dsv4-tiny", device="cpu", chunked_prefill_size=16, max_running_requests=8,
                     context_length=512)
    try:
        assert _outputs(chunked) == batch_outputs
        assert chunked.get_server_info()["num_forwards_extend"] > len(PROMPTS)  # really chunked
    finally:
        chunked.shutdown()


def test_mixed_chunk_matches_non_mixed(batch_outputs):
    mixed = Engine(model_path="dsv4-tiny", device="cpu", chunked_prefill_size=16, enable_mixed_chunk=True,
                   max_running_requests=8, context_length=512)
    try:
        assert _outputs(mixed) == batch_outputs
        assert mixed.get_server_info()["num_forwards_mixed"] > 0
    finally:
        mixed.shutdown()
        mixed.shutdown()  # idempotent
    with pytest.raises(RuntimeError, match="shut down"):
        mixed.generate("x", GREEDY)
