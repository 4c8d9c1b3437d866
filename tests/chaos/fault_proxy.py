"""A TCP proxy that injects faults between a client and a server (here: the registry and
moto's S3 server, or an executor and the registry). Modes, switchable while connections are
open:

- ``pass``: forwards both ways;
- ``refuse``: new connections are closed at once (the server is down);
- ``slow``: forwards, sleeping ``delay`` seconds before each chunk of ``chunk`` bytes;
- ``reset``: forwards ``reset_after`` bytes per connection (both ways), then resets it (RST),
  so that a transfer breaks in the middle;
- ``http500``: answers every request with ``500 Internal Server Error`` (S3 failing).
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from types import TracebackType
from typing import Literal

Mode = Literal["pass", "refuse", "slow", "reset", "http500"]

_HTTP_500 = (
    b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/xml\r\n"
    b"Content-Length: 97\r\nConnection: close\r\n\r\n"
    b"<Error><Code>InternalError</Code><Message>injected</Message><RequestId>1</RequestId></Error>"
)


class FaultProxy:
    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self.mode: Mode = "pass"
        self.delay = 0.05
        self.chunk = 16 * 1024
        self.reset_after = 64 * 1024
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self.port = int(self._listener.getsockname()[1])

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def __enter__(self) -> FaultProxy:
        self._spawn(self._accept)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self._stopped.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self.drop_connections()
        for thread in self._threads:
            thread.join(timeout=5)

    def drop_connections(self) -> None:
        """Resets every open connection (a server that vanished mid-transfer)."""
        with self._lock:
            sockets = list(self._sockets)
            self._sockets.clear()
        for sock in sockets:
            _reset(sock)

    def _spawn(self, target: object, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)  # type: ignore[arg-type]
        self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            mode = self.mode
            if mode == "refuse":
                _reset(client)
                continue
            if mode == "http500":
                self._spawn(_answer_500, client)
                continue
            try:
                upstream = socket.create_connection(self._target, timeout=5)
            except OSError:
                _reset(client)
                continue
            upstream.settimeout(None)
            with self._lock:
                self._sockets |= {client, upstream}
            budget = [self.reset_after]
            self._spawn(self._pump, client, upstream, budget)
            self._spawn(self._pump, upstream, client, budget)

    def _pump(self, source: socket.socket, sink: socket.socket, budget: list[int]) -> None:
        try:
            while True:
                data = source.recv(self.chunk)
                if not data:
                    break
                if self.mode == "slow":
                    time.sleep(self.delay)
                if self.mode == "reset":
                    budget[0] -= len(data)
                    if budget[0] < 0:
                        _reset(source)
                        _reset(sink)
                        return
                sink.sendall(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)


def _reset(sock: socket.socket) -> None:
    """Close with RST rather than FIN: the peer sees 'connection reset'."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv on it
    with contextlib.suppress(OSError):
        sock.close()


def _answer_500(client: socket.socket) -> None:
    client.settimeout(5)
    with contextlib.suppress(OSError):
        client.recv(65536)
        client.sendall(_HTTP_500)
    with contextlib.suppress(OSError):
        client.close()
