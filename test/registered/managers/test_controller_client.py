"""ControllerClient, the one client of the DP controller (TokenizerManager and DP Engine), over
real pipes standing in for two ranks' processes: routing, aborts, stats requests, reads, and
what a rank's death looks like on each side."""

import multiprocessing as mp
import threading
import types

import pytest

from sglang.srt.managers.dp.controller_client import ControllerClient
from sglang.srt.managers.dp.controller import DataParallelController
from sglang.srt.managers.dp.supervisor import RankChannel
from sglang.srt.managers.io_struct import WAKE, AbortReq, GenerateReqInput, ServerInfo, ServerInfoReq, TokenOut
from sglang.srt.server_args import ServerArgs


class _Ranks:
    """Two ranks' pipe ends as a scheduler process holds them, the controller wired to the others."""

    def __init__(self, controller):
        self.req_in, self.out = [], []
        for r in range(controller.dp_size):
            req_r, req_w = mp.Pipe(duplex=False)
            out_r, out_w = mp.Pipe(duplex=False)
            controller.supervisor.channels[r] = RankChannel(r, out_r, req_w)
            self.req_in.append(req_r)
            self.out.append(out_w)

    def received(self, rank: int, n: int) -> list:
        return [self.req_in[rank].recv() for _ in range(n) if self.req_in[rank].poll(5)]


def _client(**kw):
    controller = DataParallelController(ServerArgs(enable_dp_attention=True, dp_size=2,
                                                   load_balance_method="round_robin"))
    ranks = _Ranks(controller)
    return ControllerClient(controller, **kw), ranks


def _req(rid: str) -> GenerateReqInput:
    return GenerateReqInput(rid=rid, input_ids=[3, 4, 5])


def _done(rid: str) -> TokenOut:
    return TokenOut(rid=rid, new_token_ids=[7], finished=True, finish_reason={"type": "length", "length": 1},
                    prompt_tokens=3, completion_tokens=1)


def test_submit_sends_to_the_routed_rank_and_wakes_the_idle_one_then_abort_goes_to_the_owner():
    client, ranks = _client()
    a, b = _req("a"), _req("b")
    client.submit(a)
    client.submit(b)
    assert [m.rid for m in ranks.received(0, 1)] == ["a"]
    got1 = ranks.received(1, 2)
    assert got1[0] == WAKE and got1[1].rid == "b"  # rank 1 was idle when "a" arrived
    assert client.num_outstanding == 2 and client.owns("b")
    assert client.abort("b") is True
    assert ranks.received(1, 1) == [AbortReq(rid="b")]
    client.on_outputs([_done("b")])
    assert not client.owns("b") and client.abort("b") is False  # finished: nothing to abort
    client.request_server_info()
    assert ranks.received(0, 1) == [ServerInfoReq()] and ranks.received(1, 1) == [ServerInfoReq()]
    client.stop_sending()


def test_read_returns_each_ranks_messages_and_names_a_dead_rank():
    client, ranks = _client()
    ranks.out[1].send([_done("x")])
    ranks.out[0].send(ServerInfo(stats={"breakable_replays": 2}))
    got = []
    while len(got) < 2:
        got += client.read(timeout_s=5)
    assert sorted((r, type(m).__name__) for r, m in got) == [(0, "ServerInfo"), (1, "list")]
    with pytest.raises(RuntimeError, match="no output from any DP rank for 0 s"):
        client.read(timeout_s=0.05)
    ranks.out[1].close()  # rank 1's process is gone: EOF on our side
    with pytest.raises(RuntimeError, match="DP rank 1 on node 0 disconnected"):
        client.read(timeout_s=5)
    client.stop_sending()


def test_readers_deliver_messages_then_the_exit_and_a_failed_send_is_reported():
    failed, seen, exited = [], [], threading.Event()
    client, ranks = _client(on_send_error=failed.append)
    client.start_readers(on_message=lambda r, m: seen.append((r, m)), on_exit=lambda r: exited.set())
    ranks.out[0].send([_done("y")])
    ranks.out[0].close()
    assert exited.wait(5) and seen == [(0, [_done("y")])]
    client.controller.channels[1].send_conn.close()  # rank 1's channel closed under the sender
    client.send(1, WAKE)
    client.stop_sending()
    for t in threading.enumerate():
        if t.name == "dp-controller-sender":
            t.join(5)
    assert failed == [1]
    for ch in client.controller.channels:
        ch.close()


def test_the_dp_engine_steps_through_the_client():
    from sglang.srt.entrypoints.engine import _DPSchedulerClient

    client, ranks = _client()
    ready = types.SimpleNamespace(vocab_size=512, context_length=4096, stats={},
                                  server_args=types.SimpleNamespace(watchdog_timeout=5.0))
    engine_side = _DPSchedulerClient(client, ready)
    engine_side.add_request(_req("e"))
    assert ranks.received(0, 1)[0].rid == "e" and engine_side.has_work()
    ranks.out[0].send([_done("e")])
    assert engine_side.step() == [_done("e")] and not engine_side.has_work()
    client.stop_sending()
