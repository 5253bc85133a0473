"""TokenizerManager request admission without scheduler processes."""

import asyncio

import pytest

from sglang.srt.managers.dp.controller_client import ControllerClient
from sglang.srt.managers.dp.controller import DataParallelController
from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.managers.tokenizer_manager import RequestError, TokenizerManager
from sglang.srt.server_args import ServerArgs


def test_a_rid_is_not_reusable_while_its_abort_is_in_flight():
    """The client of request "dup" is gone (its state dropped) but the scheduler has not sent
    the final output for its abort yet: the controller still owns the rid. A new request with
    that rid must be refused, not handed the old request's abort."""
    args = ServerArgs().resolve(cuda_available=False)
    tm = TokenizerManager(args)
    tm.client = ControllerClient(DataParallelController(args))
    tm.client.controller.owner["dup"] = 0  # routed earlier, final TokenOut not yet back
    sent = []
    tm.client.send = lambda rank, msg: sent.append((rank, msg))

    async def first_chunk():  # bounded: an accepted request would wait for output forever
        gen = tm.generate(GenerateReqInput(rid="dup", input_ids=[5, 6, 7]))
        return await asyncio.wait_for(gen.__anext__(), timeout=5)

    with pytest.raises(RequestError, match="'dup' is already in use"):
        asyncio.run(first_chunk())
    tm.client.stop_sending()
    assert sent == [] and "dup" not in tm.rid_to_state


def test_every_entry_point_checks_a_prompt_the_same_way():
    """Scheduler, HTTP side and the DP Engine share check_prompt_ids; the DP Engine used to
    let a prompt larger than the KV cache through (it then came back as an error result)."""
    import types

    from sglang.srt.entrypoints.engine import _DPSchedulerClient
    from sglang.srt.managers.io_struct import check_prompt_ids, kv_capacity_tokens

    assert check_prompt_ids((3, 4), 10, 8, 6) == [3, 4]
    for ids, message in (([], "non-empty"), ([3, True], "outside the vocabulary"), ([3, 10], "outside"),
                         ([None], "token id None"), ([1, "2"], "token id str"),
                         ([1] * 8, "context length is 8"), ([1] * 7, "KV cache holds only 6")):
        with pytest.raises(ValueError, match=message):
            check_prompt_ids(ids, 10, 8, 6)
    assert kv_capacity_tokens({"num_total_pages": 3, "page_size": 128}) == 384
    assert kv_capacity_tokens({}) is None

    routed = []
    controller = types.SimpleNamespace(route=lambda req: routed.append(req.rid) or [])
    ready = types.SimpleNamespace(vocab_size=512, context_length=4096, server_args=types.SimpleNamespace(
        watchdog_timeout=30.0), stats={"num_total_pages": 2, "page_size": 128})
    client = _DPSchedulerClient(ControllerClient(controller), ready)
    with pytest.raises(ValueError, match="KV cache holds only 256"):
        client.add_request(GenerateReqInput(rid="big", input_ids=[5] * 300))
    client.add_request(GenerateReqInput(rid="ok", input_ids=[5] * 200))
    assert routed == ["ok"]
    client.client.stop_sending()


def test_http_side_rejects_what_the_scheduler_would_with_a_request_error():
    args = ServerArgs().resolve(cuda_available=False)
    tm = TokenizerManager(args)
    tm.context_length, tm.vocab_size, tm.kv_capacity = 4096, 512, 256
    with pytest.raises(RequestError, match="KV cache holds only 256"):
        tm._check_input_ids([5] * 300)
    with pytest.raises(RequestError, match="token id 999 is outside the vocabulary"):
        tm._check_input_ids([1, 2, 999])
