"""Supervisor of the scheduler processes, one per DP rank (one in all without DP attention):
starts this node's ranks, accepts the ranks of other nodes, waits until every rank is ready,
reports a rank's death and shuts them all down. It owns the channels; it has no say in which
rank serves a request (router.py).

Multi-node (--nnodes M): ranks are split evenly, node k runs ranks [k*N/M, (k+1)*N/M).
torch.distributed meets at --dist-init-addr host:port; node 0 runs the HTTP server and this
controller, which also listens on host:port+1. The ranks of nodes 1.. connect back there
(multiprocessing.connection, authenticated), so the controller talks to every rank through
the same pipe-like channel. Nodes 1.. only run `run_headless_node`.

The authkey is derived from --dist-init-addr unless SGLANG_DP_AUTHKEY is set: the derived key
only keeps unrelated launches apart. Requests are pickled: expose that port to trusted hosts
only, or set SGLANG_DP_AUTHKEY to a shared secret on every node.
"""

from __future__ import annotations

import hashlib
import logging
import multiprocessing as mp
import os
import queue
import socket
import threading
import time
from multiprocessing.connection import Connection, Listener
from multiprocessing.connection import wait as wait_for
from typing import List, Optional, Sequence

from sglang.srt.managers.io_struct import SHUTDOWN, RankHello, ReadyMsg, StartupError
from sglang.srt.managers.scheduler_process import RankSpec, run_scheduler_process

logger = logging.getLogger(__name__)

CONTROLLER_PORT_OFFSET = 1  # node 0's controller listens on the --dist-init-addr port + 1
HELLO_TIMEOUT_S = 10.0


# ---- layout and addresses -----------------------------------------------------------------


def parse_dist_init_addr(addr: str) -> tuple:
    """'host:port' (or '[v6]:port') -> (host, port)."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"--dist-init-addr must be host:port, got {addr!r}")
    return host.strip("[]"), int(port)


def node_ranks(dp_size: int, nnodes: int, node_rank: int) -> range:
    per_node = dp_size // nnodes
    return range(node_rank * per_node, (node_rank + 1) * per_node)


def controller_address(dist_init_addr: str) -> tuple:
    host, port = parse_dist_init_addr(dist_init_addr)
    return host, port + CONTROLLER_PORT_OFFSET


def controller_authkey(dist_init_addr: str) -> bytes:
    secret = os.environ.get("SGLANG_DP_AUTHKEY")
    if secret:
        return secret.encode()
    return hashlib.sha256(f"sglang-dp-controller:{dist_init_addr}".encode()).digest()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def dp_size_of(server_args) -> int:
    return server_args.dp_size if server_args.enable_dp_attention else 1


def check_dp_model(server_args) -> None:
    """Checks that need the model config, run before any rank starts (the runner would raise
    the same error in every rank, after the rendezvous)."""
    from sglang.srt.configs.loader import load_model_config
    from sglang.srt.layers.dp_attention import expert_shard

    config = load_model_config(server_args.model_path, server_args.num_layers)
    expert_shard(config.n_routed_experts, 0, dp_size_of(server_args))
    if dp_size_of(server_args) > 1:  # a dispatcher that cannot run fails here, not in every rank
        from sglang.srt.layers.moe.ep_dispatch import create_moe_dispatcher

        create_moe_dispatcher(server_args.moe_dispatcher)


def _start_rank(ctx, server_args, spec: Optional[RankSpec], req_conn, out_conn):
    name = "sglang-scheduler" if spec is None else f"sglang-scheduler-dp{spec.dp_rank}"
    proc = ctx.Process(target=run_scheduler_process, args=(server_args, req_conn, out_conn, os.getpid(), spec),
                       name=name, daemon=True)  # daemon: multiprocessing's atexit also reaps it
    proc.start()
    return proc


def _rank_spec(server_args, dp_rank: int, init_method: str, remote: bool) -> RankSpec:
    addr = server_args.dist_init_addr
    return RankSpec(
        dp_rank=dp_rank,
        dp_size=server_args.dp_size,
        init_method=init_method,
        ranks_per_node=server_args.dp_size // server_args.nnodes,
        node_rank=server_args.node_rank,
        controller_addr=controller_address(addr) if remote else None,
        authkey=controller_authkey(addr) if remote else b"",
    )


# How long a rank that was asked to stop may take before it is terminated. Ranks that agree to
# stop release their graphs and process groups and exit in well under a second on an idle host;
# a loaded host (CI, a busy node) can take several seconds, and terminating a rank that is already
# on its way out turns a clean stop into a reported failure.
SHUTDOWN_GRACE_S = 20.0
DEAD_PEER_GRACE_S = 5.0


def _stop_processes(procs: Sequence, timeout_s: float) -> None:
    """Wait up to `timeout_s` for all, then terminate, then kill: never leaves one behind."""
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for stop in ("terminate", "kill"):
        alive = [p for p in procs if p.is_alive()]
        if not alive:
            return
        for p in alive:
            getattr(p, stop)()
        for p in alive:
            p.join(min(timeout_s, 5.0))


# ---- channels -----------------------------------------------------------------------------


class RankChannel:
    """One rank's connection: two pipes for a local rank, one TCP connection for a remote one.
    `send` is safe from any thread; `recv` belongs to one reader."""

    def __init__(self, dp_rank: int, recv_conn: Connection, send_conn: Connection, proc=None, node_rank: int = 0):
        self.dp_rank = dp_rank
        self.recv_conn = recv_conn
        self.send_conn = send_conn
        self.proc = proc  # None for a rank on another node
        self.node_rank = node_rank
        self.pid: Optional[int] = proc.pid if proc is not None else None  # remote: from ReadyMsg
        self.eof = False  # the rank closed its end (seen by whoever reads)
        self._send_lock = threading.Lock()

    def send(self, msg) -> None:
        with self._send_lock:
            self.send_conn.send(msg)

    def recv(self):
        try:
            return self.recv_conn.recv()
        except (EOFError, OSError):
            self.eof = True
            raise

    def is_alive(self) -> bool:
        if self.proc is not None:
            return self.proc.is_alive()
        return not (self.eof or self.recv_conn.closed)

    def close(self) -> None:
        for c in {id(self.recv_conn): self.recv_conn, id(self.send_conn): self.send_conn}.values():
            try:
                c.close()
            except OSError:
                pass


# ---- the supervisor -----------------------------------------------------------------------


class RankSupervisor:
    """The processes and channels of every DP rank: start-up, remote ranks, health, shutdown."""

    def __init__(self, server_args):
        if server_args.nnodes > 1 and server_args.node_rank != 0:
            raise ValueError("the controller runs on node 0; other nodes run run_headless_node()")
        self.server_args = server_args
        self.dp_size = dp_size_of(server_args)
        self.channels: List[Optional[RankChannel]] = [None] * self.dp_size
        self.ready: List[Optional[ReadyMsg]] = [None] * self.dp_size
        self._listener: Optional[Listener] = None
        self._accepted: queue.Queue = queue.Queue()
        self._accepting = False
        self._closed = False

    # ---- start-up -------------------------------------------------------------------

    def launch(self, timeout_s: Optional[float] = None) -> ReadyMsg:
        """Start this node's ranks and block until every rank (all nodes) is ready. Raises
        RuntimeError with the failing rank's message; nothing is left running then."""
        try:
            return self._launch(timeout_s)
        except BaseException:
            self.shutdown(timeout_s=1.0)
            raise

    def _launch(self, timeout_s: Optional[float]) -> ReadyMsg:
        args = self.server_args
        if self.dp_size > 1:
            check_dp_model(args)
        ctx = mp.get_context("spawn")
        init_method = None
        if self.dp_size > 1:
            init_method = f"tcp://{args.dist_init_addr}" if args.dist_init_addr else f"tcp://127.0.0.1:{_free_port()}"
        if args.nnodes > 1:
            self._listen(controller_address(args.dist_init_addr), controller_authkey(args.dist_init_addr),
                         self.dp_size - self.dp_size // args.nnodes)
        for r in node_ranks(self.dp_size, args.nnodes, 0):
            req_r, req_w = ctx.Pipe(duplex=False)
            out_r, out_w = ctx.Pipe(duplex=False)
            spec = _rank_spec(args, r, init_method, remote=False) if self.dp_size > 1 else None
            proc = _start_rank(ctx, args, spec, req_r, out_w)
            # Drop our copies of the child's ends: then the child exiting is EOF on our side.
            req_r.close()
            out_w.close()
            self.channels[r] = RankChannel(r, out_r, req_w, proc)
        self._await_ready(None if timeout_s is None else time.monotonic() + timeout_s)
        self._stop_listening()
        first = self.ready[0]
        if self.dp_size > 1:
            logger.info("%d DP ranks ready (load balance: %s)", self.dp_size, self.server_args.load_balance_method)
        return ReadyMsg(server_args=first.server_args, context_length=min(m.context_length for m in self.ready),
                        vocab_size=first.vocab_size, pid=first.pid, stats=first.stats)

    def _await_ready(self, deadline: Optional[float]) -> None:
        while not all(self.ready):
            self._adopt_remote_ranks()
            waiting = [c for c in self.channels if c is not None and self.ready[c.dp_rank] is None]
            handles = [c.recv_conn for c in waiting] + [c.proc.sentinel for c in waiting if c.proc is not None]
            if handles:
                wait_for(handles, timeout=0.2)
            else:  # only remote ranks left, none connected yet
                time.sleep(0.05)
            for ch in waiting:
                if ch.recv_conn.poll():
                    try:
                        msg = ch.recv()
                    except (EOFError, OSError):
                        raise RuntimeError(self._startup_exit_message(ch)) from None
                    self._on_startup_msg(ch, msg)
                elif not ch.is_alive():
                    raise RuntimeError(self._startup_exit_message(ch))
            if deadline is not None and time.monotonic() > deadline:
                missing = [r for r in range(self.dp_size) if self.ready[r] is None]
                raise RuntimeError(f"scheduler processes not ready in time (waiting for DP ranks {missing})"
                                   if self.dp_size > 1 else "scheduler process not ready in time")

    def _on_startup_msg(self, ch: RankChannel, msg) -> None:
        if isinstance(msg, StartupError):
            if self.dp_size == 1:
                raise RuntimeError(f"scheduler process failed to start:\n{msg.message}")
            raise RuntimeError(f"DP rank {ch.dp_rank} failed to start: {msg.summary}\n{msg.message}")
        if not isinstance(msg, ReadyMsg):
            raise RuntimeError(f"DP rank {ch.dp_rank} sent {type(msg).__name__} before it was ready")
        ch.pid = msg.pid
        self.ready[ch.dp_rank] = msg

    def _startup_exit_message(self, ch: RankChannel) -> str:
        if ch.proc is None:
            return f"DP rank {ch.dp_rank} (node {ch.node_rank}) disconnected during start-up"
        ch.proc.join(1.0)
        who = "scheduler process" if self.dp_size == 1 else f"scheduler process of DP rank {ch.dp_rank}"
        return f"{who} exited during start-up (exit code {ch.proc.exitcode})"

    # ---- remote ranks ---------------------------------------------------------------

    def _listen(self, address: tuple, authkey: bytes, num_remote: int) -> None:
        self._listener = Listener(address, authkey=authkey)
        self._accepting = True
        threading.Thread(target=self._accept_loop, args=(self._listener, num_remote), name="dp-accept",
                         daemon=True).start()

    def _accept_loop(self, listener: Listener, num_remote: int) -> None:
        accepted = 0
        while accepted < num_remote and self._accepting:
            try:
                conn = listener.accept()
                hello = conn.recv() if conn.poll(HELLO_TIMEOUT_S) else None
            except Exception as e:  # noqa: BLE001 - a bad peer (wrong key, ...) must not stop us
                if self._accepting:
                    logger.warning("rejected a connection to the DP controller: %s: %s", type(e).__name__, e)
                continue
            if not isinstance(hello, RankHello) or not 0 <= hello.dp_rank < self.dp_size:
                logger.warning("rejected a connection to the DP controller: no valid hello (%r)", hello)
                conn.close()
                continue
            try:
                conn.send(self.server_args)  # the rank checks its node's arguments against these
            except OSError:
                continue
            self._accepted.put((hello, conn))
            accepted += 1

    def _adopt_remote_ranks(self) -> None:
        while True:
            try:
                hello, conn = self._accepted.get_nowait()
            except queue.Empty:
                return
            if self.channels[hello.dp_rank] is not None:
                conn.close()
                raise RuntimeError(f"DP rank {hello.dp_rank} connected twice (node {hello.node_rank}); "
                                   "check --node-rank on every node")
            self.channels[hello.dp_rank] = RankChannel(hello.dp_rank, conn, conn, None, hello.node_rank)
            logger.info("DP rank %d of node %d connected", hello.dp_rank, hello.node_rank)

    def _stop_listening(self) -> None:
        listener, self._listener = self._listener, None
        if listener is None:
            return
        self._accepting = False
        address = listener.address
        listener.close()
        try:  # wake an accept() that still waits; it sees the listener closed and ends
            socket.create_connection(address, timeout=1.0).close()
        except OSError:
            pass

    # ---- health and shutdown ----------------------------------------------------------

    @property
    def pids(self) -> List[Optional[int]]:
        return [c.pid if c is not None else None for c in self.channels]

    def first_dead_rank(self) -> Optional[int]:
        return next((c.dp_rank for c in self.channels if c is not None and not c.is_alive()), None)

    def death_message(self, rank: int) -> str:
        ch = self.channels[rank]
        if ch.proc is None:
            return f"DP rank {rank} on node {ch.node_rank} disconnected (its scheduler process or node is gone)"
        ch.proc.join(1.0)
        who = "the scheduler process" if self.dp_size == 1 else f"the scheduler process of DP rank {rank}"
        return f"{who} exited unexpectedly (exit code {ch.proc.exitcode})"

    def shutdown(self, timeout_s: float = SHUTDOWN_GRACE_S) -> None:
        """Ask every rank to stop (ranks agree on when, then release graphs before the process
        groups), then terminate and kill this node's ranks that are still there after
        `timeout_s`: after a rank died the others may sit in a collective until its timeout."""
        if self._closed:
            return
        self._closed = True
        self._stop_listening()
        channels = [c for c in self.channels if c is not None]
        if any(c.proc is not None and c.proc.exitcode not in (None, 0) for c in channels):
            # a rank died: the others may sit in a collective with it and never read SHUTDOWN
            timeout_s = min(timeout_s, DEAD_PEER_GRACE_S)
        # A thread: a send to a rank that is stuck (full pipe) must not block the shutdown.
        sender = threading.Thread(target=_send_all, args=(channels, SHUTDOWN), name="dp-shutdown", daemon=True)
        sender.start()
        deadline = time.monotonic() + timeout_s
        _stop_processes([c.proc for c in channels if c.proc is not None], timeout_s)
        for c in channels:
            if c.proc is not None and c.proc.exitcode != 0:
                logger.warning("the scheduler process of DP rank %d ended with exit code %s", c.dp_rank,
                               c.proc.exitcode)
        # Remote ranks: closing first could reset the connection before they read SHUTDOWN.
        # Their EOF is seen by the reader (TokenizerManager's threads); without one, wait out.
        sender.join(max(0.0, deadline - time.monotonic()))
        while any(c.proc is None and c.is_alive() for c in channels) and time.monotonic() < deadline:
            time.sleep(0.05)
        for c in channels:
            c.close()


def _send_all(channels: Sequence[RankChannel], msg) -> None:
    for c in channels:
        try:
            c.send(msg)
        except (OSError, ValueError):  # gone already / closed meanwhile
            pass



# ---- nodes other than 0 -------------------------------------------------------------------


def run_headless_node(server_args) -> int:
    """Run this node's ranks, which connect to node 0's controller, until they exit. Returns 0
    when all stopped cleanly (node 0 shut down), 1 as soon as one failed (the rest are then
    terminated: they would otherwise wait in a collective until its timeout)."""
    ctx = mp.get_context("spawn")
    init_method = f"tcp://{server_args.dist_init_addr}"
    ranks = node_ranks(server_args.dp_size, server_args.nnodes, server_args.node_rank)
    procs = {r: _start_rank(ctx, server_args, _rank_spec(server_args, r, init_method, remote=True), None, None)
             for r in ranks}
    logger.info("node %d: DP ranks %s started; serving for node 0 at %s", server_args.node_rank, list(ranks),
                server_args.dist_init_addr)
    try:
        while True:
            running = [p for p in procs.values() if p.exitcode is None]
            failed = [(r, p.exitcode) for r, p in procs.items() if p.exitcode not in (None, 0)]
            if failed:
                r, code = failed[0]
                logger.error("DP rank %d exited with code %s: stopping this node", r, code)
                return 1
            if not running:
                return 0
            wait_for([p.sentinel for p in running], timeout=1.0)
    except KeyboardInterrupt:  # SIGINT/SIGTERM
        return 0
    finally:
        _stop_processes(list(procs.values()), timeout_s=5.0)
