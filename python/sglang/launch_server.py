"""`python -m sglang.launch_server [server args]`: the HTTP server in this process, the
scheduler (model) in a child process, one per DP rank with --enable-dp-attention --dp-size N.
With no arguments: dsv4-tiny with random weights on port 30000, on the GPU if there is one.
Listens only once every model is ready; SIGINT/SIGTERM stop all processes; exits non-zero if
a scheduler process dies.

Multi-node: every node runs the same command with its own --node-rank; node 0 serves HTTP,
the others (`--node-rank k > 0`) only run their DP ranks and block until node 0 stops."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys

from sglang.srt.entrypoints.http_server import serve
from sglang.srt.managers.dp.supervisor import run_headless_node
from sglang.srt.managers.tokenizer_manager import TokenizerManager
from sglang.srt.server_args import ServerArgs
from sglang.srt.server_args_cli import prepare_server_args

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
        if server_args.nnodes > 1 and server_args.node_rank > 0:
            return run_headless_node(server_args)
        _check_port_free(server_args.host, server_args.port)
        manager = TokenizerManager(server_args)
        manager.launch()
        args = manager.server_args  # resolved by the scheduler process
        url = f"http://{args.host}:{args.port}"
        dp = f", DP attention over {args.dp_size} ranks ({args.load_balance_method})" if args.dp_size > 1 else ""
        ready = (
            f"sglang server ready at {url} (model {manager.served_model_name}, device {args.device}, "
            f"context {manager.context_length}{dp})"
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
    try:
        server_args = prepare_server_args(sys.argv[1:] if argv is None else argv)
    except (ValueError, NotImplementedError) as e:  # argument rules: one line, no traceback
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    logging.basicConfig(
        level=getattr(logging, server_args.log_level.upper()),
        format="[server] %(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    sys.exit(launch_server(server_args))


if __name__ == "__main__":
    main()
