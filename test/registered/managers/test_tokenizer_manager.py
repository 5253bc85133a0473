"""TokenizerManager request admission without scheduler processes."""

import asyncio

import pytest

from sglang.srt.managers.dp_controller import DataParallelController
from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.managers.tokenizer_manager import RequestError, TokenizerManager
from sglang.srt.server_args import ServerArgs


def test_a_rid_is_not_reusable_while_its_abort_is_in_flight():
    """The client of request "dup" is gone (its state dropped) but the scheduler has not sent
    the final output for its abort yet: the controller still owns the rid. A new request with
    that rid must be refused, not handed the old request's abort."""
    args = ServerArgs().resolve(cuda_available=False)
    tm = TokenizerManager(args)
    tm.controller = DataParallelController(args)
    tm.controller.owner["dup"] = 0  # routed earlier, final TokenOut not yet back
    sent = []
    tm._send_to = lambda rank, msg: sent.append((rank, msg))

    async def first_chunk():  # bounded: an accepted request would wait for output forever
        gen = tm.generate(GenerateReqInput(rid="dup", input_ids=[5, 6, 7]))
        return await asyncio.wait_for(gen.__anext__(), timeout=5)

    with pytest.raises(RequestError, match="'dup' is already in use"):
        asyncio.run(first_chunk())
    assert sent == [] and "dup" not in tm.rid_to_state
