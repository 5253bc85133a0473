"""The scheduler process: builds ModelRunner + Scheduler, then loops receiving requests from
the server process and sending TokenOut batches back. Two one-way pipes connect them (one
TCP connection, both ways, for a DP rank on a node other than 0).

Protocol (parent -> child): GenerateReqInput | AbortReq | ServerInfoReq | SHUTDOWN | WAKE.
Protocol (child -> parent): first a ReadyMsg (or a StartupError with the traceback), then
lists of TokenOut (one list per step) and ServerInfo replies, in order. A rank that connects
over TCP sends a RankHello before anything else and gets node 0's ServerArgs back.

Under DP attention (`RankSpec.dp_size > 1`) the process joins the DP process groups first,
then steps in lockstep with the other ranks (DPSchedulerLoop).
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Optional

from sglang.srt.managers.io_struct import SHUTDOWN, WAKE, RankHello, ReadyMsg, StartupError  # noqa: F401

logger = logging.getLogger(__name__)

# Idle wait on the input pipe: it wakes at once on a message or on EOF (parent gone), so this
# only bounds how late a parent that died without closing the pipe is noticed.
IDLE_POLL_S = 0.5
# Under DP, idle ranks still meet in a collective every iteration (about 2 ms of CPU each on
# a CPU host: the first rank in spins until the last arrives). Between two such meetings they
# wait on their pipe, from the shortest wait doubling to the longest while the server stays
# idle. WAKE ends the wait, so a new request does not pay for it; the longest wait bounds only
# how late a shutdown is agreed and the rare request that reaches an idle rank without WAKE.
DP_IDLE_WAIT_S = (0.005, 0.05)


@dataclass(frozen=True)
class RankSpec:
    """Where a scheduler process sits among the DP ranks (None/default: no DP)."""

    dp_rank: int = 0
    dp_size: int = 1
    init_method: Optional[str] = None  # torch.distributed rendezvous, e.g. tcp://host:port
    ranks_per_node: int = 1  # CPU ranks of one node share its cores
    node_rank: int = 0
    # Ranks on nodes other than 0 connect back to node 0's controller instead of using pipes.
    controller_addr: Optional[tuple] = None
    authkey: bytes = b""


def _die_with_parent() -> None:
    # Linux: the kernel kills us if the parent dies, even while the model is still loading
    # (the main loop's pipe-EOF/ppid checks only run once loading is done).
    if sys.platform != "linux":
        return
    try:
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def run_scheduler_process(server_args, req_conn: Optional[Connection], out_conn: Optional[Connection],
                          parent_pid: int, rank: Optional[RankSpec] = None):
    """Entry point of the child (multiprocessing "spawn"). Exits non-zero after a start-up
    error or a failed DP step."""
    # Ctrl-C reaches the whole process group; the server process owns shutdown and tells us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        return
    rank = rank or RankSpec()
    prefix = "scheduler" if rank.dp_size == 1 else f"scheduler dp{rank.dp_rank}"
    logging.basicConfig(
        level=getattr(logging, str(getattr(server_args, "log_level", "info")).upper(), logging.INFO),
        format=f"[{prefix}] %(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if rank.controller_addr is not None:
        req_conn = out_conn = _connect_to_controller(rank, server_args.watchdog_timeout)
    try:
        if rank.controller_addr is not None:
            check_same_args(_recv_node0_args(req_conn), server_args, rank.node_rank)
        scheduler, ready = _build(server_args, rank)
    except BaseException as e:  # noqa: BLE001 - the parent needs the text of any start-up failure
        logger.error("start-up failed: %s: %s", type(e).__name__, e)
        # Expected failures (bad arguments or model files, a missing device) are one line; a
        # traceback is for bugs.
        expected = isinstance(e, (ValueError, NotImplementedError, FileNotFoundError))
        detail = f"{type(e).__name__}: {e}" if expected else traceback.format_exc()
        out_conn.send(StartupError(detail, f"{type(e).__name__}: {e}", rank.dp_rank))
        if rank.dp_size > 1:  # process-group destructors may wait on peers that are gone
            logging.shutdown()
            os._exit(1)
        sys.exit(1)
    out_conn.send(ready)
    if rank.dp_size == 1:
        loop = SchedulerLoop(scheduler, req_conn, out_conn, parent_pid)
        threading.Thread(target=loop.watchdog, args=(ready.server_args.watchdog_timeout,), daemon=True).start()
        try:
            loop.run()
        except (EOFError, BrokenPipeError, ConnectionResetError):
            pass  # the server process is gone: nothing left to serve
    else:
        _run_dp_rank(scheduler, rank, req_conn, out_conn, parent_pid)
        # Destroy the process-group objects now, with the last references: left to interpreter
        # exit, their C++ destructors sometimes abort ("terminate called without an active
        # exception").
        del scheduler
        gc.collect()
    logger.info("scheduler process exiting")
    # Everything that needs an orderly release (graphs, process groups, the pipes' last sends) is
    # released above. A spawned child otherwise leaves through full interpreter finalization,
    # whose C++ destructors (thread pools, gloo) can take seconds on a loaded host: long enough
    # for the server to terminate a rank that had already stopped cleanly.
    # multiprocessing's own exit steps still run (they unlink the semaphores this process made).
    import multiprocessing.util

    multiprocessing.util._exit_function()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _connect_to_controller(rank: RankSpec, timeout_s: float) -> Connection:
    """Node 0 may still be starting: retry until `timeout_s`."""
    from multiprocessing.connection import Client

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            conn = Client(tuple(rank.controller_addr), authkey=rank.authkey)
            break
        except OSError as e:
            if time.monotonic() > deadline:
                logger.error("cannot reach node 0's controller at %s:%s: %s", *rank.controller_addr, e)
                sys.exit(1)
            time.sleep(0.2)
    conn.send(RankHello(rank.dp_rank, rank.node_rank))
    return conn


def _recv_node0_args(conn: Connection):
    if not conn.poll(30.0):
        raise RuntimeError("node 0's controller did not answer the hello within 30 s")
    return conn.recv()


# Per-node by nature; every other argument must be the same on all nodes, or the ranks would
# capture different graphs and their collectives would not line up.
_PER_NODE_ARGS = ("node_rank", "host", "port", "log_level")


def check_same_args(node0_args, local_args, node_rank: int) -> None:
    import dataclasses

    diffs = [f"--{f.name.replace('_', '-')} (node 0: {getattr(node0_args, f.name)!r}, "
             f"node {node_rank}: {getattr(local_args, f.name)!r})"
             for f in dataclasses.fields(local_args)
             if f.name not in _PER_NODE_ARGS and getattr(node0_args, f.name) != getattr(local_args, f.name)]
    if diffs:
        raise ValueError(f"node {node_rank} was started with other arguments than node 0 (every node needs the "
                         f"same ones): {'; '.join(diffs)}")


def _build(server_args, rank: Optional[RankSpec] = None):
    import torch

    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.tokenizer import get_tokenizer

    rank = rank or RankSpec()
    use_cuda = torch.cuda.is_available() and server_args.device != "cpu"
    if rank.dp_size > 1 and use_cuda:
        # Before resolve(): it sizes the KV cache from this rank's GPU's free memory.
        torch.cuda.set_device(rank.dp_rank % torch.cuda.device_count())
    # Resolved here, not in the server process: querying free GPU memory there would create
    # a CUDA context in a process that never uses the GPU.
    server_args = server_args.resolve(cuda_available=torch.cuda.is_available())
    if rank.dp_size > 1:
        _init_dp(server_args, rank)
    model_runner = ModelRunner(server_args)
    tokenizer = get_tokenizer(server_args.model_path, getattr(server_args, "tokenizer_path", None))
    # The scheduler matches stop strings on decoded text, with the server's tokenizer.
    scheduler = Scheduler(server_args, model_runner, decode_fn=tokenizer.decode)
    ready = ReadyMsg(
        server_args=server_args,
        context_length=int(scheduler.context_length),
        vocab_size=int(model_runner.config.vocab_size),
        pid=os.getpid(),
        stats=scheduler.get_stats(),
        dp_rank=rank.dp_rank,
    )
    return scheduler, ready


def _init_dp(server_args, rank: RankSpec) -> None:
    import torch

    from sglang.srt.distributed.parallel_state import init_dp_groups

    # The ranks of one node share its cores; each taking all of them (torch's default) makes
    # their thread pools fight: on CPU every collective slows by an order of magnitude, on
    # GPU the host-side step work (metadata, buffer fills) does. An explicit OMP_NUM_THREADS wins.
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // rank.ranks_per_node))
    if server_args.device == "cuda":
        # NVLink multicast hung on the H200 hosts this was built on (docs/design.md, contract 9).
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    init_dp_groups(rank.dp_rank, rank.dp_size, rank.init_method, device, timeout_s=server_args.watchdog_timeout)


def _run_dp_rank(scheduler, rank: RankSpec, req_conn: Connection, out_conn: Connection, parent_pid: int) -> None:
    from sglang.srt.distributed.parallel_state import destroy_dp_groups, get_dp_groups
    from sglang.srt.model_executor.dp_sync import DPStepSync

    # --debug-cuda-graph also verifies every step's decision across ranks (one extra tiny
    # all-gather) so a disagreement fails with the step and ranks named, before any MoE
    # collective could hang on it.
    dp_sync = DPStepSync(get_dp_groups().cpu_group, rank.dp_rank, rank.dp_size, scheduler.model_runner.graph_tables,
                         verify=scheduler.server_args.debug_cuda_graph)
    loop = DPSchedulerLoop(scheduler, req_conn, out_conn, parent_pid, dp_sync)
    threading.Thread(target=loop.watchdog, args=(scheduler.server_args.watchdog_timeout,), daemon=True).start()
    try:
        loop.run()
    except BaseException:
        # A failed collective (a peer rank died, a consensus error): leave at once. Normal
        # interpreter exit could block in a process group's destructor.
        logger.exception("DP rank %d failed", rank.dp_rank)
        logging.shutdown()
        os._exit(1)
    # Graphs first: destroying a process group under live graphs hangs.
    scheduler.model_runner.shutdown()
    destroy_dp_groups()
    loop.scheduler = loop.dp_sync = None  # the watchdog thread keeps `loop` alive


class SchedulerLoop:
    def __init__(self, scheduler, req_conn: Connection, out_conn: Connection, parent_pid: int):
        self.scheduler = scheduler
        self.req_conn = req_conn
        self.out_conn = out_conn
        self.parent_pid = parent_pid
        self.running = True
        self.step_started: float | None = None  # monotonic time of the step in progress

    def run(self) -> None:
        while self.running:
            busy = self.scheduler.has_work()
            # Busy: only drain what is already there. Idle: block until a message arrives.
            if self.req_conn.poll(0 if busy else IDLE_POLL_S):
                self._drain()
            elif not busy and os.getppid() != self.parent_pid:
                return
            if self.running and self.scheduler.has_work():
                self.step_started = time.monotonic()
                outs = self.scheduler.step()
                self.step_started = None
                if outs:
                    self.out_conn.send(outs)

    def watchdog(self, timeout_s: float) -> None:
        """A step stuck for `timeout_s` (a hung kernel or collective) kills this process, so
        the server fails its requests and exits instead of hanging forever."""
        while True:
            time.sleep(min(5.0, timeout_s / 4))
            started = self.step_started
            if started is not None and time.monotonic() - started > timeout_s:
                logger.error("a scheduler step has run for over %.0f s: exiting (watchdog)", timeout_s)
                os._exit(2)

    def _drain(self) -> None:
        errors = []
        while self.running and self.req_conn.poll():
            self._handle(self.req_conn.recv(), errors)  # EOFError when the parent is gone
        if errors:
            self.out_conn.send(errors)

    def _handle(self, msg, errors: list) -> None:
        from sglang.srt.managers.io_struct import AbortReq, GenerateReqInput, ServerInfoReq

        if isinstance(msg, GenerateReqInput):
            try:
                self.scheduler.add_request(msg)
            except ValueError as e:
                errors.append(_error_out(msg, str(e)))
        elif isinstance(msg, AbortReq):
            self.scheduler.abort_request(msg.rid)
        elif isinstance(msg, ServerInfoReq):
            self.out_conn.send(_server_info(self.scheduler))
        elif msg == SHUTDOWN:
            self.running = False
        elif msg == WAKE:
            pass
        else:
            logger.error("scheduler process: unknown message %r", type(msg))


class DPSchedulerLoop(SchedulerLoop):
    """One DP rank. Every iteration is one `scheduler.step(dp_sync)`, which starts with a
    collective exchange, so all ranks iterate in lockstep, with or without local work.

    Leaving is agreed, not unilateral: a rank that leaves while another waits in a collective
    would stall it until the process-group timeout. On SHUTDOWN (or when the server is gone) a
    rank aborts its requests; at the next step where no rank ran a forward (a decision every
    rank takes identically) all ranks all-reduce their stop flags and leave together. Steps
    with work pay nothing for this.
    """

    def __init__(self, scheduler, req_conn: Connection, out_conn: Connection, parent_pid: int, dp_sync):
        super().__init__(scheduler, req_conn, out_conn, parent_pid)
        self.dp_sync = dp_sync
        self.stop_requested = False
        self.conn_closed = False
        self.live_rids: set[str] = set()
        self.idle_wait_s = DP_IDLE_WAIT_S[0]

    def run(self) -> None:
        while True:
            if not self.conn_closed and self._poll(0):
                self._drain()
            forwards = self._num_forwards()
            self.step_started = time.monotonic()
            outs = self.scheduler.step(self.dp_sync)
            self.step_started = None
            if outs:
                self._send(outs)
            if self._num_forwards() != forwards:
                self.idle_wait_s = DP_IDLE_WAIT_S[0]
            else:  # no rank had work: the same on every rank
                if self._all_agree_to_stop():
                    return
                self._idle_wait()

    def _num_forwards(self) -> int:
        return sum(self.scheduler.num_forwards.values())

    def _all_agree_to_stop(self) -> bool:
        import torch
        import torch.distributed as dist

        flag = torch.tensor([int(self.stop_requested)], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.dp_sync.group)
        return bool(flag.item())

    def _idle_wait(self) -> None:
        if os.getppid() != self.parent_pid:
            self._request_stop()
        if self.conn_closed:
            time.sleep(self.idle_wait_s)
        elif self._poll(self.idle_wait_s):
            return  # a message: keep the wait short, work may follow
        self.idle_wait_s = min(2 * self.idle_wait_s, DP_IDLE_WAIT_S[1])

    def _poll(self, timeout: float) -> bool:
        try:
            return self.req_conn.poll(timeout)
        except (EOFError, OSError):
            self._lost_server()
            return False

    def _drain(self) -> None:
        errors = []
        try:
            while self.req_conn.poll():
                self._handle(self.req_conn.recv(), errors)
        except (EOFError, OSError):
            self._lost_server()
        if errors:
            self._send(errors)

    def _handle(self, msg, errors: list) -> None:
        from sglang.srt.managers.io_struct import GenerateReqInput

        if msg == SHUTDOWN:
            self._request_stop()
        elif isinstance(msg, GenerateReqInput):
            if self.stop_requested:
                errors.append(_error_out(msg, "the server is shutting down"))
                return
            n = len(errors)
            super()._handle(msg, errors)
            if len(errors) == n:
                self.live_rids.add(msg.rid)
        else:
            super()._handle(msg, errors)

    def _request_stop(self) -> None:
        if not self.stop_requested:
            self.stop_requested = True
            for rid in list(self.live_rids):  # become idle soon, so the stop can be agreed
                self.scheduler.abort_request(rid)

    def _lost_server(self) -> None:
        self.conn_closed = True
        self._request_stop()

    def _send(self, outs: list) -> None:
        for out in outs:
            if out.finished:
                self.live_rids.discard(out.rid)
        if self.conn_closed:
            return
        try:
            self.out_conn.send(outs)
        except (EOFError, OSError):
            self._lost_server()


def _error_out(req, message: str):
    from sglang.srt.managers.io_struct import TokenOut

    return TokenOut(
        rid=req.rid,
        new_token_ids=[],
        finished=True,
        finish_reason=None,
        prompt_tokens=len(req.input_ids),
        completion_tokens=0,
        error=message,
    )


def _server_info(scheduler):
    from sglang.srt.managers.io_struct import ServerInfo

    return ServerInfo(stats=scheduler.get_stats())
