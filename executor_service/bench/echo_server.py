"""A bare grpcio echo server: the transport floor for ``bench.forward`` (not product API).

``/bench.Echo/Unary`` answers each message with its own bytes, ``/bench.Echo/Stream`` does the
same for every message of a bidirectional stream. No protobuf parsing, no work: what a Forward
of the same payload sizes costs over this machine's loopback with Python grpcio, the least any
Forward can cost. ``--server aio`` runs it on grpc.aio instead of the thread-pool server, to
compare the two server models. ``--processes N`` serves from N processes on the one port
(``grpc.so_reuseport``, the kernel spreading connections over them), as the executor's front
ends do: the floor of a server with that many GILs.

    python -m executor_service.bench.echo_server --listen 127.0.0.1:0   # prints the port
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from concurrent import futures

import grpc
import grpc.aio

UNARY = "/bench.Echo/Unary"
STREAM = "/bench.Echo/Stream"
_OPTIONS = [
    ("grpc.max_receive_message_length", 256 * 1024 * 1024),
    ("grpc.max_send_message_length", 256 * 1024 * 1024),
]


def _unary(request: bytes, context: grpc.ServicerContext) -> bytes:
    return request


def _stream(requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
    yield from requests


async def _aio_unary(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
    return request


async def _aio_stream(
    requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext[bytes, bytes]
) -> AsyncIterator[bytes]:
    async for request in requests:
        yield request


def _handler(unary: object, stream: object) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(
        "bench.Echo",
        {
            "Unary": grpc.unary_unary_rpc_method_handler(unary),
            "Stream": grpc.stream_stream_rpc_method_handler(stream),
        },
    )


def serve_threads(listen: str, workers: int, processes: int = 1, shared: bool = False) -> None:
    """Serves until terminated; with ``processes`` > 1, that many processes share the port
    (this one and copies of it, stopped with it). ``shared``: one of those copies."""
    reuse = [("grpc.so_reuseport", 1 if processes > 1 or shared else 0)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers), options=_OPTIONS + reuse)
    server.add_generic_rpc_handlers((_handler(_unary, _stream),))
    port = server.add_insecure_port(listen)
    server.start()
    host = listen.rsplit(":", 1)[0]
    copies = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "executor_service.bench.echo_server",
                f"--listen={host}:{port}",
                f"--workers={workers}",
                f"--parent={os.getpid()}",
            ],
            stdout=subprocess.DEVNULL,
        )
        for _ in range(processes - 1)
    ]
    print(port, flush=True)
    try:
        server.wait_for_termination()
    finally:
        for copy in copies:
            copy.terminate()
            copy.wait()


def _exit_with(parent: int) -> None:
    """A copy's watch: it leaves when the process that started it has gone."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)


async def serve_aio(listen: str) -> None:
    server = grpc.aio.server(options=_OPTIONS)
    server.add_generic_rpc_handlers((_handler(_aio_unary, _aio_stream),))
    port = server.add_insecure_port(listen)
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--listen", default="127.0.0.1:0")
    parser.add_argument("--server", choices=["threads", "aio"], default="threads")
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument(
        "--processes", type=int, default=1, help="server processes on the port (threads only)"
    )
    parser.add_argument("--parent", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    # SIGTERM unwinds, so that the copies of a multi-process server stop too.
    signal.signal(signal.SIGTERM, lambda signum, _frame: sys.exit(128 + signum))
    if args.parent is not None:
        threading.Thread(target=_exit_with, args=(args.parent,), daemon=True).start()
    try:
        if args.server == "aio":
            asyncio.run(serve_aio(args.listen))
        else:
            serve_threads(args.listen, args.workers, args.processes, args.parent is not None)
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
