"""return_logprob / top_logprobs_num: the log-softmax of the model's logits at each generated
token (temperature 1, no filtering), checked against a forward of the same runner."""

import math

import pytest
import torch

from sglang.srt.entrypoints.engine import Engine
from sglang.srt.model_executor.forward_batch_info import ForwardMode, build_forward_batch

PROMPT = [17, 99, 3, 250, 41, 8, 77]


@pytest.fixture(scope="module", params=[False, True], ids=["overlap", "no_overlap"])
def engine(request):
    e = Engine(model_path="dsv4-tiny", device="cpu", context_length=256, max_running_requests=4,
               disable_overlap_schedule=request.param)
    yield e
    e.shutdown()


def _logprobs_of_next_token(engine, ids):
    """log-softmax of the runner's logits after `ids`, from one eager forward."""
    runner = engine.model_runner
    slot = runner.req_to_token_pool.alloc_req()
    try:
        runner.req_to_token_pool.ensure_capacity(slot, len(ids))
        fb = build_forward_batch(ForwardMode.EXTEND, [slot], [0], [ids], runner.device)
        with torch.inference_mode():
            logits = runner.forward(fb).next_token_logits
        return torch.log_softmax(logits[0].float(), dim=-1)
    finally:
        runner.req_to_token_pool.free_req(slot)


def test_logprobs_equal_the_log_softmax_of_a_forward_at_every_step(engine):
    params = {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True}
    res = engine.generate(input_ids=PROMPT, sampling_params=params, return_logprob=True, top_logprobs_num=4)
    ids, meta = res["output_ids"], res["meta_info"]
    assert [tok for _, tok, _ in meta["output_token_logprobs"]] == ids
    for step, ((lp, tok, _), top) in enumerate(zip(meta["output_token_logprobs"], meta["output_top_logprobs"])):
        want = _logprobs_of_next_token(engine, PROMPT + ids[:step])
        assert lp == pytest.approx(float(want[tok]), abs=1e-4)
        best = torch.topk(want, 4)
        assert [t for _, t, _ in top] == best.indices.tolist()
        assert [v for v, _, _ in top] == pytest.approx(best.values.tolist(), abs=1e-4)
        assert top[0][1] == tok  # greedy


def test_sampled_tokens_report_the_unfiltered_distribution(engine):
    # top_k 2 + temperature: the token is one of the two most likely; its logprob is still the
    # model's (temperature 1, no filtering), so it matches that token's entry in the top list.
    params = {"temperature": 0.7, "top_k": 2, "max_new_tokens": 6, "seed": 5, "ignore_eos": True}
    res = engine.generate(input_ids=PROMPT, sampling_params=params, return_logprob=True, top_logprobs_num=2)
    meta = res["meta_info"]
    for (lp, tok, _), top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"]):
        assert tok in [t for _, t, _ in top]
        assert lp == dict((t, v) for v, t, _ in top)[tok]
    total = sum(math.exp(v) for v, _, _ in meta["output_top_logprobs"][0])
    assert 0 < total <= 1 + 1e-5


def test_only_the_asking_request_gets_them_and_the_tokens_do_not_change(engine):
    params = {"temperature": 0.0, "max_new_tokens": 3, "ignore_eos": True}
    a, b = engine.generate(input_ids=[PROMPT, PROMPT[:4]], sampling_params=params, return_logprob=True)
    plain = engine.generate(input_ids=[PROMPT, PROMPT[:4]], sampling_params=params)
    assert [a["output_ids"], b["output_ids"]] == [p["output_ids"] for p in plain]
    assert len(a["meta_info"]["output_token_logprobs"]) == 3 and "output_top_logprobs" not in a["meta_info"]
    assert all("output_token_logprobs" not in p["meta_info"] for p in plain)


@pytest.mark.parametrize("kwargs, needle", [
    (dict(return_logprob="yes"), "return_logprob"),
    (dict(return_logprob=True, top_logprobs_num=21), "top_logprobs_num"),
    (dict(return_logprob=True, top_logprobs_num=-1), "top_logprobs_num"),
    (dict(top_logprobs_num=2), "needs return_logprob"),
])
def test_bad_logprob_arguments_are_refused(engine, kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        engine.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 2}, **kwargs)


@pytest.mark.gpu
def test_logprobs_on_cuda_come_back_with_the_ids_one_step_late():
    """The CUDA path: logprobs copied to pinned memory with the ids under one event (overlap on,
    BCG and decode graphs), equal to a forward's log-softmax."""
    e = Engine(model_path="dsv4-tiny", device="cuda", dtype="float32", context_length=256, max_running_requests=4,
               enable_breakable_cuda_graph=True)
    try:
        params = {"temperature": 0.0, "max_new_tokens": 5, "ignore_eos": True}
        res = e.generate(input_ids=PROMPT, sampling_params=params, return_logprob=True, top_logprobs_num=2)
        ids = res["output_ids"]
        for step, (lp, tok, _) in enumerate(res["meta_info"]["output_token_logprobs"]):
            want = _logprobs_of_next_token(e, PROMPT + ids[:step])
            assert tok == ids[step] and lp == pytest.approx(float(want[tok].cpu()), abs=1e-3)
        assert e.get_server_info()["num_overlap_steps"] > 0
    finally:
        e.shutdown()
