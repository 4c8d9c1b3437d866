"""Byte ranges of presigned URLs (S3's, or the registry's blob HTTP server's) received straight
into the caller's memory.

``UrlRangeReader.read`` sends one HTTP Range GET and lets the socket write the body into memory
the caller's ``Sink`` gives, a step at a time (the executor gives the file being downloaded,
its memory map): the bytes are copied once, by the kernel, with the GIL released, instead of
into a new bytes object per chunk and then again into the file. Each reader keeps its
connections open between requests (HTTP/1.1 keep-alive), one per request in flight; a kept
connection the server closed meanwhile is replaced once, before any byte of the answer
arrived, as urllib3 does.

The bytes are unchecked, like every ranged read: the caller hashes them.
"""

from __future__ import annotations

import http.client
import ssl
import threading
from typing import Protocol
from urllib.parse import urlsplit

#: Bytes received per step: the caller learns of arrivals (and may stop) at this grain. Each
#: step takes the GIL back: at 3.5 GB/s, 1 MiB steps did so 3 500 times a second beside the
#: executor's Forward calls (4 MiB: Forward p90 during a cold load 4.3–7.3 ms against 8.8–9.6
#: on an H100 host, docs/executor.md).
STEP_BYTES = 4 << 20


class Sink(Protocol):
    """Where a range's bytes go, in order: ``receive(n)`` is writable memory for the next
    ``n`` bytes (at most ``STEP_BYTES``), ``received(n)`` says they landed there and returns
    whether to go on."""

    def receive(self, n: int) -> memoryview: ...

    def received(self, n: int) -> bool: ...


#: Errors of a kept connection that the server had closed while it was idle.
_STALE = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError)


def tls_context(root_certificates: bytes | None) -> ssl.SSLContext:
    """Trusts the system's CAs and ``root_certificates`` (PEM; a private CA's, as the registry's
    TLS certificate may be signed by): the URLs may be S3's as well as the registry's."""
    context = ssl.create_default_context()
    if root_certificates:
        context.load_verify_locations(cadata=root_certificates.decode())
    return context


class UrlUnreachable(ConnectionError):
    """No connection could be made to the URL's host (refused, unknown name, timed out): the
    URL itself is likely wrong for this client, as opposed to a transfer that failed."""


class HttpStatusError(Exception):
    """The server answered a status other than the range (``status``, its first words)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message


class UrlRangeReader:
    """Reads ranges of http(s) URLs into buffers; thread-safe (each call takes a connection of
    its own). ``ssl_context``: for https, None = the system's trusted CAs."""

    def __init__(self, *, timeout: float, ssl_context: ssl.SSLContext | None = None) -> None:
        self._timeout = timeout
        self._ssl = ssl_context
        self._lock = threading.Lock()
        self._idle: dict[tuple[str, str], list[http.client.HTTPConnection]] = {}

    def read(self, url: str, offset: int, length: int, sink: Sink) -> None:
        """Receives bytes ``offset`` to ``offset + length`` of ``url``'s object into ``sink``
        a step at a time; returns early when it says to stop. Raises UrlUnreachable when no
        connection can be made, HttpStatusError for an answer that is not the range,
        ConnectionError when the body ends short, OSError and http.client.HTTPException for
        the transport's other failures."""
        if not length:
            return
        parts = urlsplit(url)
        origin = (parts.scheme, parts.netloc)
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        headers = {"Range": f"bytes={offset}-{offset + length - 1}"}
        connection, reused = self._take(origin)
        try:
            try:
                connection.request("GET", target, headers=headers)
                response = connection.getresponse()
            except _STALE:
                if not reused:
                    raise
                connection.close()  # closed by the server while it was idle: once more, fresh
                connection = self._connect(origin)
                connection.request("GET", target, headers=headers)
                response = connection.getresponse()
            complete = self._receive(response, offset, length, sink)
        except BaseException:
            connection.close()
            raise
        if complete and not response.will_close:
            self._give_back(origin, connection)
        else:
            connection.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
        for connections in idle.values():
            for connection in connections:
                connection.close()

    def _receive(
        self, response: http.client.HTTPResponse, offset: int, length: int, sink: Sink
    ) -> bool:
        """Hands ``response``'s body to ``sink``; False if it stopped first."""
        if response.status != 206 and not (response.status == 200 and offset == 0):
            text = response.read(500).decode("utf-8", "replace").strip()
            raise HttpStatusError(response.status, text or str(response.reason))
        if response.length != length:
            # A 200 to a range from 0 is the whole object: right only if that is the range.
            raise HttpStatusError(
                response.status,
                f"answered {response.length} bytes for a range of {length} at {offset}",
            )
        done = 0
        while done < length:
            step = sink.receive(min(STEP_BYTES, length - done))
            if not step:
                raise ValueError("the sink gave no memory to receive into")
            filled = 0
            while filled < len(step):
                n = response.readinto(step[filled:])
                if not n:
                    raise ConnectionError(
                        f"the body ended at byte {offset + done + filled}, "
                        f"expected {offset + length}"
                    )
                filled += n
            if not sink.received(filled):
                return False
            done += filled
        return True

    def _take(self, origin: tuple[str, str]) -> tuple[http.client.HTTPConnection, bool]:
        with self._lock:
            idle = self._idle.get(origin)
            if idle:
                return idle.pop(), True
        return self._connect(origin), False

    def _give_back(self, origin: tuple[str, str], connection: http.client.HTTPConnection) -> None:
        with self._lock:
            self._idle.setdefault(origin, []).append(connection)

    def _connect(self, origin: tuple[str, str]) -> http.client.HTTPConnection:
        scheme, netloc = origin
        connection: http.client.HTTPConnection
        if scheme == "https":
            connection = http.client.HTTPSConnection(
                netloc, timeout=self._timeout, context=self._ssl
            )
        elif scheme == "http":
            connection = http.client.HTTPConnection(netloc, timeout=self._timeout)
        else:
            raise ValueError(f"not an http(s) URL: {scheme}://{netloc}")
        try:
            connection.connect()  # here, so that failing to connect is told apart
        except (OSError, http.client.HTTPException) as exc:
            connection.close()
            raise UrlUnreachable(f"cannot connect to {scheme}://{netloc}: {exc}") from exc
        return connection
