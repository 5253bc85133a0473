"""One tiny CPU server for the benchmark clients' tests (greedy_agreement, bench_serving)."""

import sys

import pytest

from sglang.test.server_process import ServerProcess, free_port


@pytest.fixture(scope="package")
def tiny_server(tmp_path_factory):
    port = free_port()
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", "dsv4-tiny", "--device", "cpu",
           "--port", str(port)]
    server = ServerProcess(cmd, port, tmp_path_factory.mktemp("tiny_server") / "server.log")
    server.wait_ready(180, poll_s=0.25)
    yield server
    server.stop()
