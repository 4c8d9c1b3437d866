"""A TCP proxy on 127.0.0.1 that cuts or silently stalls its connections, for tests of what a
broken network does to a client."""

from __future__ import annotations

import contextlib
import socket
import threading


class CuttingProxy:
    """Forwards 127.0.0.1 TCP connections to ``target``; once ``limit`` more bytes came from
    the server (counted from when it is set) it cuts the connection (``stall``: stops
    forwarding and holds it open). ``source``: the address the server sees them come from
    (another loopback address is another client address to the server)."""

    def __init__(self, target: str, source: str = "") -> None:
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self._source = (source, 0) if source else None
        self.limit: int | None = None
        self.stall = False
        self.forwarded = threading.Event()  # set once a connection reached its limit
        self.bytes_from_server = 0  # all connections, cuts included
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._sockets: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self._target, source_address=self._source)
            self._sockets += [client, server]
            threading.Thread(target=self._pipe, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, True), daemon=True).start()

    def _pipe(self, source: socket.socket, dest: socket.socket, metered: bool) -> None:
        try:
            while data := source.recv(65536):
                if metered:
                    self.bytes_from_server += len(data)
                limit = self.limit if metered else None
                if limit is not None and len(data) > limit:
                    dest.sendall(data[:limit])
                    self.limit = 0
                    self.forwarded.set()
                    if not self.stall:
                        _cut(source)
                        _cut(dest)
                    return
                if limit is not None:
                    self.limit = limit - len(data)
                dest.sendall(data)
        except OSError:
            pass

    def reset(self) -> None:
        self.limit, self.stall, self.bytes_from_server = None, False, 0
        self.forwarded.clear()

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        for sock in self._sockets:
            _cut(sock)


def _cut(sock: socket.socket) -> None:
    """Closes a connection so that its peer sees it closed at once. A plain close from one
    thread, while another thread is blocked receiving on the socket, sends nothing until that
    receive returns: the peer (a gRPC channel without keepalive) would wait forever."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()
