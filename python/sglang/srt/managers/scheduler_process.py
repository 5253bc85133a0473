"""The scheduler process: builds ModelRunner + Scheduler, then loops receiving requests from
the server process and sending TokenOut batches back. Two one-way pipes connect them.

Protocol (parent -> child): GenerateReqInput | AbortReq | ServerInfoReq | SHUTDOWN.
Protocol (child -> parent): first a ReadyMsg (or a StartupError with the traceback), then
lists of TokenOut (one list per step) and ServerInfo replies, in order.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

logger = logging.getLogger(__name__)

SHUTDOWN = "shutdown"
# Idle wait on the input pipe: it wakes at once on a message or on EOF (parent gone), so this
# only bounds how late a parent that died without closing the pipe is noticed.
IDLE_POLL_S = 0.5


@dataclass
class ReadyMsg:
    server_args: object  # resolved here, where the device is: the server shows these
    context_length: int
    vocab_size: int
    pid: int
    stats: dict = field(default_factory=dict)


@dataclass
class StartupError:
    message: str


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


def run_scheduler_process(server_args, req_conn: Connection, out_conn: Connection, parent_pid: int):
    """Entry point of the child (multiprocessing "spawn")."""
    # Ctrl-C reaches the whole process group; the server process owns shutdown and tells us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        return
    logging.basicConfig(
        level=getattr(logging, str(getattr(server_args, "log_level", "info")).upper(), logging.INFO),
        format="[scheduler] %(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        scheduler, ready = _build(server_args)
    except BaseException:  # noqa: BLE001 - the parent needs the text of any start-up failure
        out_conn.send(StartupError(traceback.format_exc()))
        return
    out_conn.send(ready)
    loop = SchedulerLoop(scheduler, req_conn, out_conn, parent_pid)
    threading.Thread(target=loop.watchdog, args=(ready.server_args.watchdog_timeout,), daemon=True).start()
    try:
        loop.run()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the server process is gone: nothing left to serve
    finally:
        logger.info("scheduler process exiting")


def _build(server_args):
    import torch

    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.tokenizer import get_tokenizer

    # Resolved here, not in the server process: querying free GPU memory there would create
    # a CUDA context in a process that never uses the GPU.
    server_args = server_args.resolve(cuda_available=torch.cuda.is_available())
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
    )
    return scheduler, ready


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
        from sglang.srt.managers.io_struct import AbortReq, GenerateReqInput, ServerInfoReq

        errors = []
        while self.running and self.req_conn.poll():
            msg = self.req_conn.recv()  # EOFError when the parent is gone: run() ends
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
            else:
                logger.error("scheduler process: unknown message %r", type(msg))
        if errors:
            self.out_conn.send(errors)


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
