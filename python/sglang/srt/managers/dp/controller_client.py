"""The one client of the DP controller, shared by the TokenizerManager (HTTP server) and the
offline DP Engine: it sends requests, aborts and stats requests to the ranks' channels through
one sender thread, and reads the ranks' outputs, either by per-rank reader threads (an event
loop's callbacks) or by a blocking `read` (a synchronous caller). Routing and load bookkeeping
stay in the controller; the caller calls `submit`, `abort` and `on_outputs` from one thread."""

from __future__ import annotations

import queue
import threading
from multiprocessing.connection import wait as wait_for
from typing import Callable, List, Optional

from sglang.srt.managers.io_struct import AbortReq, GenerateReqInput, ServerInfoReq


class ControllerClient:
    def __init__(self, controller, on_send_error: Optional[Callable[[int], None]] = None):
        """`on_send_error(rank)` runs on the sender thread when a rank's channel is gone or
        closed; without it the failure is left to whoever reads (the rank's EOF)."""
        self.controller = controller
        self._on_send_error = on_send_error
        self._sends: queue.Queue = queue.Queue()
        # A thread, so a full pipe (a rank busy writing its outputs in a long step) never
        # blocks the caller, and the caller and a rank can never deadlock writing to each other.
        threading.Thread(target=self._sender, name="dp-controller-sender", daemon=True).start()

    @property
    def dp_size(self) -> int:
        return self.controller.dp_size

    # ---- sending (any thread) ---------------------------------------------------------

    def send(self, rank: int, msg) -> None:
        self._sends.put((rank, msg))

    def _sender(self) -> None:
        while (item := self._sends.get()) is not None:
            rank, msg = item
            try:
                self.controller.channels[rank].send(msg)
            except (OSError, ValueError):  # gone, or closed by shutdown
                if self._on_send_error is not None:
                    self._on_send_error(rank)

    # ---- requests (the caller's one thread) --------------------------------------------

    def submit(self, req: GenerateReqInput) -> None:
        """Send `req` to the rank the controller picks (and WAKE to idle ranks)."""
        for rank, msg in self.controller.route(req):
            self.send(rank, msg)

    def abort(self, rid: str) -> bool:
        """Abort `rid` on the rank that owns it; False when no rank does (it finished)."""
        rank = self.controller.owner_of(rid)
        if rank is None:
            return False
        self.send(rank, AbortReq(rid=rid))
        return True

    def owns(self, rid: str) -> bool:
        """Whether a rank still holds `rid` (its final output has not come back)."""
        return self.controller.owner_of(rid) is not None

    def on_outputs(self, outs) -> None:
        """Every TokenOut list read from a rank, so finished requests release their rank."""
        self.controller.on_outputs(outs)

    @property
    def num_outstanding(self) -> int:
        return self.controller.num_outstanding

    def request_server_info(self) -> None:
        """Ask every rank for its ServerInfo; each answers in its output stream, in order."""
        for rank in range(self.dp_size):
            self.send(rank, ServerInfoReq())

    # ---- reading ----------------------------------------------------------------------

    def start_readers(self, on_message: Callable[[int, object], None], on_exit: Callable[[int], None]) -> None:
        """One thread per rank: `on_message(rank, msg)` for every message, then `on_exit(rank)`
        once at the rank's EOF. Both run on the reader thread."""
        for rank in range(self.dp_size):
            threading.Thread(target=self._reader, args=(rank, on_message, on_exit), name=f"scheduler-reader-{rank}",
                             daemon=True).start()

    def _reader(self, rank: int, on_message, on_exit) -> None:
        channel = self.controller.channels[rank]
        while True:
            try:
                msg = channel.recv()
            except (EOFError, OSError):
                on_exit(rank)
                return
            on_message(rank, msg)

    def read(self, timeout_s: float) -> List[tuple]:
        """(rank, message) for every message ready within `timeout_s`, blocking. Raises
        RuntimeError if no rank sent anything in time or a rank died (the controller's message)."""
        channels = self.controller.channels
        ready = wait_for([c.recv_conn for c in channels], timeout=timeout_s)
        if not ready:
            raise RuntimeError(f"no output from any DP rank for {timeout_s:.0f} s")
        got = []
        for c in channels:
            while c.recv_conn in ready and c.recv_conn.poll():
                try:
                    got.append((c.dp_rank, c.recv()))
                except (EOFError, OSError):
                    raise RuntimeError(self.controller.death_message(c.dp_rank)) from None
        return got

    # ---- shutdown ---------------------------------------------------------------------

    def stop_sending(self) -> None:
        """End the sender thread once what is queued has been written."""
        self._sends.put(None)

    def shutdown(self, timeout_s: Optional[float] = None) -> None:
        """Stop sending, then stop the ranks through the controller (ask, terminate, kill; None:
        the supervisor's grace period)."""
        self.stop_sending()
        self.controller.shutdown(timeout_s)
