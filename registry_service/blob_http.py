"""The registry's blob HTTP server: local blobs at signed URLs, with Range, sent by sendfile.

What GetDownloadUrls hands out when the blob store is a local directory (S3 presigns its own).
A gRPC stream carries every byte through Python (read, copied into a message, framed, sent,
all under the GIL); here the kernel copies the file to the socket (``loop.sendfile`` uses
``os.sendfile``), so a registry process serves many parallel ranged reads at the speed of its
page cache and network. Over TLS (the registry's certificate) the bytes go through Python's ssl
module instead: correct, not zero-copy.

One asyncio event loop in a thread of its own serves every connection: an idle or slow client
costs a file descriptor and a few kilobytes, never a thread. What a client may hold is bounded
(``HttpLimits``): connections at once (more get 503 at once), a listen backlog sized for a fleet
connecting together, and deadlines that do not restart with each byte: a request head must be
complete within ``head_seconds`` of its first byte, a kept-alive connection may sit idle
``idle_seconds``, and a response must be taken at ``min_bytes_per_second`` (after a
``head_seconds`` start). HTTP/1.1 is parsed by h11. ``BlobReads`` decides what each request
gets. A response always carries a Content-Length that is the truth at the time of the headers:
if the file turns out shorter while it is sent (a damaged store), the connection is closed
short, which every HTTP client reports as an incomplete body, never as a complete one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import threading
from dataclasses import dataclass
from http import HTTPStatus
from urllib.parse import urlsplit

import h11
from prometheus_client import Counter, Gauge

from moelora.client.logs import internal_error_message, log_event
from registry_service.blob_reads import BlobRead, BlobReads, HttpRefusal, UrlMaker
from registry_service.blobs.local import LocalBlobStore
from registry_service.url_signing import UrlSigner

log = logging.getLogger(__name__)

HTTP_REQUESTS = Counter(
    "moelora_registry_blob_http_requests_total",
    "Requests to the blob HTTP server, by status code",
    ["code"],
)
HTTP_BYTES = Counter(
    "moelora_registry_blob_http_bytes_total", "Blob bytes sent by the blob HTTP server"
)
HTTP_CONNECTIONS = Gauge(
    "moelora_registry_blob_http_connections", "Connections open to the blob HTTP server"
)
HTTP_CUT = Counter(
    "moelora_registry_blob_http_cut_total",
    "Connections the blob HTTP server ended, by reason (full, head_timeout, idle, slow_reader, "
    "bad_request)",
    ["reason"],
)

#: The largest request head read (a real one is a few hundred bytes).
_MAX_HEAD_BYTES = 16 * 1024
_READ_BYTES = 64 * 1024


@dataclass(frozen=True)
class HttpLimits:
    """What one client may hold of the blob HTTP server; see the module docstring."""

    max_connections: int = 512
    backlog: int = 4096
    head_seconds: float = 10.0
    idle_seconds: float = 60.0
    min_bytes_per_second: int = 256 * 1024


class _Cut(Exception):
    """The connection ends now; ``reason`` labels the metric."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class BlobHttpServer:
    """Serves ``blobs`` at URLs signed by ``signer``. Binds ``listen`` (``host:port``, port 0:
    any free one) at once; ``urls`` makes the URLs (under ``public_url``, default the bound
    address); ``start`` serves in a thread of its own; ``close`` stops taking connections,
    lets transfers in progress finish for up to ``grace_seconds`` and cuts the rest."""

    def __init__(
        self,
        listen: str,
        blobs: LocalBlobStore,
        signer: UrlSigner,
        *,
        public_url: str = "",
        tls: ssl.SSLContext | None = None,
        grace_seconds: float = 5.0,
        limits: HttpLimits | None = None,
    ) -> None:
        host, _, port = listen.rpartition(":")
        self._host = host
        self._tls = tls
        self._grace = grace_seconds
        self.limits = limits or HttpLimits()
        self._reads = BlobReads(blobs, signer)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.create_server(
            (host.strip("[]"), int(port)), family=family, backlog=self.limits.backlog
        )
        self.urls = UrlMaker(signer, public_url or self.default_base_url())
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self._busy = 0
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="blob-http", daemon=True
        )

    @property
    def port(self) -> int:
        return int(self._socket.getsockname()[1])

    @property
    def open_connections(self) -> int:
        return len(self._connections)

    def default_base_url(self) -> str:
        """``http(s)://HOST:PORT`` of the bound socket; a wildcard address (0.0.0.0, ::) says
        the host's name instead, which only some networks resolve: set the public URL."""
        host = self._host.strip("[]")
        if host in ("", "0.0.0.0", "::"):
            host = socket.gethostname()
        if ":" in host:
            host = f"[{host}]"
        scheme = "https" if self._tls is not None else "http"
        return f"{scheme}://{host}:{self.port}"

    def start(self) -> None:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(10)
        log_event(log, "blob_http_started", address=f"{self._host}:{self.port}")

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(
            self._accept,
            sock=self._socket,
            ssl=self._tls,
            ssl_handshake_timeout=self.limits.head_seconds if self._tls else None,
            limit=_MAX_HEAD_BYTES,
        )

    def drop_connections(self) -> None:
        """Ends every connection now (what a restart does to clients)."""
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._cancel_all(), self._loop).result(10)

    def close(self) -> None:
        if not self._thread.is_alive():
            self._socket.close()
            self._loop.close()
            return
        asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(self._grace + 10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()  # no new connections
        deadline = self._loop.time() + self._grace
        while self._busy and self._loop.time() < deadline:
            await asyncio.sleep(0.05)
        await self._cancel_all()
        if self._server is not None:
            await self._server.wait_closed()

    async def _cancel_all(self) -> None:
        tasks = list(self._connections)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- one connection -------------------------------------------------------------------------

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if len(self._connections) >= self.limits.max_connections:
            HTTP_CUT.labels("full").inc()
            await self._refuse_full(writer)
            return
        self._connections.add(task)
        HTTP_CONNECTIONS.inc()
        try:
            await self._serve(reader, writer)
        except _Cut as cut:
            HTTP_CUT.labels(cut.reason).inc()
        except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError) as exc:
            peer = writer.get_extra_info("peername")
            log_event(log, "blob_http_connection_lost", client=str(peer), error=repr(exc))
        except asyncio.CancelledError:
            pass  # closing, or the connections dropped
        except Exception:
            log_event(log, "blob_http_internal_error", logging.ERROR, exc_info=True)
        finally:
            self._connections.discard(task)
            HTTP_CONNECTIONS.dec()
            writer.transport.abort()

    async def _refuse_full(self, writer: asyncio.StreamWriter) -> None:
        body = (
            f"{self.limits.max_connections} connections are open, the most this registry "
            "serves (--http-max-connections); retry shortly\n"
        ).encode()
        head = (
            f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\n"
            f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
        ).encode()
        HTTP_REQUESTS.labels("503").inc()
        with contextlib.suppress(OSError, asyncio.TimeoutError):
            writer.write(head + body)
            async with asyncio.timeout(1.0):
                await writer.drain()
        writer.transport.abort()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=_MAX_HEAD_BYTES)
        while True:
            request = await self._next_request(conn, reader)
            if request is None:
                return
            await self._answer(conn, request, writer)
            # The request's end (GET and HEAD carry no body): h11 then takes the next one.
            while conn.their_state is h11.SEND_BODY:
                if conn.next_event() is h11.NEED_DATA:
                    raise _Cut("bad_request")  # a body: not a request this server takes
            if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                return
            try:
                conn.start_next_cycle()
            except h11.LocalProtocolError:
                return

    async def _next_request(
        self, conn: h11.Connection, reader: asyncio.StreamReader
    ) -> h11.Request | None:
        """The next request's head; None when the client closed between requests. The wait
        for its first byte is bounded by ``idle_seconds``, the whole head by ``head_seconds``
        from then: a trickle of bytes does not keep a connection."""
        limits = self.limits
        deadline: float | None = None
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError:  # malformed, or a head over _MAX_HEAD_BYTES
                raise _Cut("bad_request") from None
            if isinstance(event, h11.Request):
                return event
            if event is h11.PAUSED or isinstance(event, h11.ConnectionClosed):
                return None
            if event is not h11.NEED_DATA:
                continue  # the previous request's end
            now = self._loop.time()
            if deadline is None and conn.their_state is h11.IDLE and not conn.trailing_data[0]:
                wait, reason = limits.idle_seconds, "idle"
            else:
                deadline = deadline or now + limits.head_seconds
                wait, reason = deadline - now, "head_timeout"
            try:
                async with asyncio.timeout(max(0.0, wait)):
                    data = await reader.read(_READ_BYTES)
            except TimeoutError:
                raise _Cut(reason) from None
            if deadline is None:
                deadline = self._loop.time() + limits.head_seconds
            try:
                conn.receive_data(data)
            except h11.RemoteProtocolError:
                raise _Cut("bad_request") from None

    async def _answer(
        self, conn: h11.Connection, request: h11.Request, writer: asyncio.StreamWriter
    ) -> None:
        target = request.target.decode("latin-1")
        if request.method not in (b"GET", b"HEAD"):
            await self._send_refusal(
                conn, writer, request, HttpRefusal(HTTPStatus.METHOD_NOT_ALLOWED, "GET or HEAD")
            )
            return
        range_header = next(
            (value.decode("latin-1") for name, value in request.headers if name == b"range"),
            None,
        )
        self._busy += 1
        try:
            try:
                read = self._reads.open(target, range_header)
            except HttpRefusal as refusal:
                await self._send_refusal(conn, writer, request, refusal)
                return
            except Exception:
                # The path only: its query is a grant to read the blob.
                message = internal_error_message(
                    "blob_http_internal_error", path=urlsplit(target).path
                )
                failure = HttpRefusal(HTTPStatus.INTERNAL_SERVER_ERROR, message)
                await self._send_refusal(conn, writer, request, failure)
                return
            with read.file:
                await self._send(conn, writer, read, body=request.method == b"GET")
        finally:
            self._busy -= 1

    async def _send(
        self, conn: h11.Connection, writer: asyncio.StreamWriter, read: BlobRead, body: bool
    ) -> None:
        status = HTTPStatus.PARTIAL_CONTENT if read.partial else HTTPStatus.OK
        headers = [
            ("Content-Type", "application/octet-stream"),
            ("Content-Length", str(read.length)),
            ("Accept-Ranges", "bytes"),
            *read.headers.items(),
        ]
        HTTP_REQUESTS.labels(str(status.value)).inc()
        length = read.length if body else 0
        budget = self.limits.head_seconds + length / self.limits.min_bytes_per_second
        try:
            async with asyncio.timeout(budget):
                writer.write(conn.send(h11.Response(status_code=status.value, headers=headers)))
                await writer.drain()
                if not length:
                    writer.write(conn.send(h11.EndOfMessage()))
                    await writer.drain()
                    return
                sent = await self._loop.sendfile(
                    writer.transport, read.file, read.begin, length, fallback=True
                )
        except TimeoutError:
            raise _Cut("slow_reader") from None
        HTTP_BYTES.inc(sent)
        if sent != length:
            # The file is shorter than it was when the headers went out: end the connection
            # short so that the client sees an incomplete body.
            log_event(
                log, "blob_http_short_send", logging.WARNING,
                blob=read.key, sent=sent, expected=length,
            )  # fmt: skip
            raise _Cut("short_file")
        # The body went past h11 (sendfile): tell it the message is complete.
        conn.send_with_data_passthrough(h11.Data(data=_Sent(length)))  # type: ignore[arg-type]
        writer.write(conn.send(h11.EndOfMessage()))

    async def _send_refusal(
        self,
        conn: h11.Connection,
        writer: asyncio.StreamWriter,
        request: h11.Request,
        refusal: HttpRefusal,
    ) -> None:
        body = (refusal.message + "\n").encode()
        headers = [
            ("Content-Type", "text/plain; charset=utf-8"),
            ("Content-Length", str(len(body))),
            *refusal.headers.items(),
        ]
        HTTP_REQUESTS.labels(str(refusal.status.value)).inc()
        if refusal.status == HTTPStatus.FORBIDDEN:
            log_event(log, "blob_url_refused", logging.WARNING, reason=refusal.message)
        async with asyncio.timeout(self.limits.head_seconds):
            response = h11.Response(status_code=refusal.status.value, headers=headers)
            writer.write(conn.send(response))
            if request.method != b"HEAD":
                writer.write(conn.send(h11.Data(data=body)))
            writer.write(conn.send(h11.EndOfMessage()))
            await writer.drain()


class _Sent:
    """Stands for body bytes that sendfile wrote (h11 counts them by ``len``)."""

    def __init__(self, length: int) -> None:
        self._length = length

    def __len__(self) -> int:
        return self._length
