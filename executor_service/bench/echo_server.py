"""A bare grpcio echo server: the transport floor for ``bench.forward`` (not product API).

``/bench.Echo/Unary`` answers each message with its own bytes, ``/bench.Echo/Stream`` does the
same for every message of a bidirectional stream. No protobuf parsing, no work: what a Forward
of the same payload sizes costs over this machine's loopback with Python grpcio, the least any
Forward can cost. ``--server aio`` runs it on grpc.aio instead of the thread-pool server, to
compare the two server models.

    python -m executor_service.bench.echo_server --listen 127.0.0.1:0   # prints the port
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import AsyncIterator, Iterator
from concurrent import futures

import grpc
import grpc.aio

UNARY = "/bench.Echo/Unary"
STREAM = "/bench.Echo/Stream"
_OPTIONS = [
    ("grpc.max_receive_message_length", 256 * 1024 * 1024),
    ("grpc.max_send_message_length", 256 * 1024 * 1024),
    ("grpc.so_reuseport", 0),
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


def serve_threads(listen: str, workers: int) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers), options=_OPTIONS)
    server.add_generic_rpc_handlers((_handler(_unary, _stream),))
    port = server.add_insecure_port(listen)
    server.start()
    print(port, flush=True)
    server.wait_for_termination()


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
    args = parser.parse_args(argv)
    try:
        if args.server == "aio":
            asyncio.run(serve_aio(args.listen))
        else:
            serve_threads(args.listen, args.workers)
    except KeyboardInterrupt:
        sys.exit(0)


if __name__ == "__main__":
    main()
