"""`python -m sglang.launch_server [server args]`: the HTTP server in this process, the
scheduler (model) in a child process. With no arguments: dsv4-tiny with random weights on
port 30000, on the GPU if there is one. Listens only once the model is ready; SIGINT/SIGTERM
stop both processes; exits non-zero if the scheduler process dies."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys

from sglang.srt.entrypoints.http_server import serve
from sglang.srt.managers.tokenizer_manager import TokenizerManager
from sglang.srt.server_args import ServerArgs, prepare_server_args

logger = logging.getLogger("sglang.launch_server")


def _check_port_free(host: str, port: int) -> None:
    # Fail in a second, not after minutes of model loading.
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise RuntimeError(f"cannot listen on {host}:{port}: {e}") from None


def _interrupt(signum, _frame):
    raise KeyboardInterrupt(signal.Signals(signum).name)


def launch_server(server_args: ServerArgs) -> int:
    """Run the server until a signal (returns 0) or a failure (returns 1)."""
    # Until the event loop takes over the signals, SIGTERM interrupts start-up like Ctrl-C,
    # so the `finally` below always reaps the scheduler process.
    previous = signal.signal(signal.SIGTERM, _interrupt)
    manager = None
    try:
        _check_port_free(server_args.host, server_args.port)
        manager = TokenizerManager(server_args)
        manager.launch()
        args = manager.server_args  # resolved by the scheduler process
        url = f"http://{args.host}:{args.port}"
        ready = (
            f"sglang server ready at {url} (model {manager.served_model_name}, device {args.device}, "
            f"context {manager.context_length})"
        )
        return asyncio.run(serve(manager, args.host, args.port, ready_message=ready))
    except KeyboardInterrupt:
        logger.info("interrupted during start-up")
        return 0
    except (RuntimeError, ValueError) as e:  # bad arguments, or the model failed to load
        logger.error("%s", e)
        return 1
    finally:
        if manager is not None:
            manager.shutdown()
        signal.signal(signal.SIGTERM, previous)


def main(argv=None) -> None:
    server_args = prepare_server_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=getattr(logging, server_args.log_level.upper()),
        format="[server] %(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    sys.exit(launch_server(server_args))


if __name__ == "__main__":
    main()
