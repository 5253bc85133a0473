"""A `launch_server` (or any HTTP server) child process for tests: start, wait for /health,
read its log, stop with SIGTERM (then kill). Every wait is bounded."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional, Sequence


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, cmd: Sequence[str], port: int, log_path: Path, env: Optional[dict] = None):
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.proc = subprocess.Popen(list(cmd), stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=env)

    def wait_ready(self, timeout_s: float = 180, poll_s: float = 0.1) -> "ServerProcess":
        """Until /health answers 200; raises with the server's log if it exits or times out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            # urllib, not requests: test modules that only start servers need no client library
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as resp:
                    if resp.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass  # not listening yet, or answering 503 while it starts
            time.sleep(poll_s)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout_s} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# ---- process hygiene (Linux: reads /proc) --------------------------------------------------


def _parent_of(stat: str) -> int:
    return int(stat.rsplit(")", 1)[1].split()[1])  # the field after the state, past "(comm)"


def descendant_pids(pid: int) -> list:
    """Every live descendant of `pid` (children, their children, ...)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = _parent_of((entry / "stat").read_text())
            except OSError:
                continue
    found, frontier = [], [pid]
    while frontier:
        parent = frontier.pop()
        kids = [c for c, p in parents.items() if p == parent]
        found += kids
        frontier += kids
    return found


def pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")  # a zombie has exited, it only waits to be reaped


def still_alive_after(pids: Sequence[int], timeout_s: float = 10) -> list:
    """The pids still running once they have all exited or `timeout_s` has passed."""
    deadline = time.monotonic() + timeout_s
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if pid_alive(p)]
