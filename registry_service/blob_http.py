"""The registry's blob HTTP server: local blobs at signed URLs, with Range, sent by sendfile.

What GetDownloadUrls hands out when the blob store is a local directory (S3 presigns its own).
A gRPC stream carries every byte through Python (read, copied into a message, framed, sent,
all under the GIL); here the kernel copies the file to the socket (``socket.sendfile`` uses
``os.sendfile``, which holds no GIL while it runs), so a registry process serves many parallel
ranged reads at the speed of its page cache and network. Over TLS (the registry's certificate)
the bytes go through Python's ssl module instead: correct, not zero-copy.

The server is stdlib's ThreadingHTTPServer speaking HTTP/1.1 with keep-alive, one thread per
connection; ``BlobReads`` decides what each request gets. A response always carries a
Content-Length that is the truth at the time of the headers: if the file turns out shorter
while it is sent (a damaged store), the connection is closed short, which every HTTP client
reports as an incomplete body, never as a complete one.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import sys
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import Counter

from moelora.client.logs import log_event
from registry_service.blob_reads import BlobRead, BlobReads, HttpRefusal, UrlMaker
from registry_service.blobs.local import LocalBlobStore
from registry_service.url_signing import UrlSigner
from shared.grpc_server import internal_error_message

log = logging.getLogger(__name__)

HTTP_REQUESTS = Counter(
    "moelora_registry_blob_http_requests_total",
    "Requests to the blob HTTP server, by status code",
    ["code"],
)
HTTP_BYTES = Counter(
    "moelora_registry_blob_http_bytes_total", "Blob bytes sent by the blob HTTP server"
)

#: A connection that sends nothing (idle keep-alive, or a stalled reader) for this long is
#: closed, so that threads of vanished clients do not pile up.
_IDLE_SECONDS = 60.0


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: a download stream reuses its connection
    server: _Server
    timeout = _IDLE_SECONDS

    def setup(self) -> None:
        super().setup()
        self.server.track(self.connection, open_=True)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.track(self.connection, open_=False)

    def do_GET(self) -> None:
        self._answer(body=True)

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def _answer(self, body: bool) -> None:
        with self.server.busy():
            try:
                read = self.server.reads.open(self.path, self.headers.get("Range"))
            except HttpRefusal as refusal:
                self._refuse(refusal)
                return
            except Exception:
                message = internal_error_message("blob_http_internal_error", path=self.path)
                self._refuse(HttpRefusal(HTTPStatus.INTERNAL_SERVER_ERROR, message))
                return
            with read.file:
                self._send(read, body)

    def _send(self, read: BlobRead, body: bool) -> None:
        status = HTTPStatus.PARTIAL_CONTENT if read.partial else HTTPStatus.OK
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(read.length))
        self.send_header("Accept-Ranges", "bytes")
        for name, value in read.headers.items():
            self.send_header(name, value)
        self.end_headers()
        HTTP_REQUESTS.labels(str(status.value)).inc()
        if not body or not read.length:
            return
        sent = self.connection.sendfile(read.file, read.begin, read.length)
        HTTP_BYTES.inc(sent)
        if sent != read.length:
            # The file is shorter than it was when the headers went out: end the connection
            # short so that the client sees an incomplete body.
            self.close_connection = True
            log_event(
                log, "blob_http_short_send", logging.WARNING,
                blob=read.key, sent=sent, expected=read.length,
            )  # fmt: skip

    def _refuse(self, refusal: HttpRefusal) -> None:
        body = (refusal.message + "\n").encode()
        self.send_response(refusal.status)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        for name, value in refusal.headers.items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        HTTP_REQUESTS.labels(str(refusal.status.value)).inc()
        if refusal.status == HTTPStatus.FORBIDDEN:
            log_event(log, "blob_url_refused", logging.WARNING, reason=refusal.message)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the events that matter are logged above, as one JSON line each


class _Server(ThreadingHTTPServer):
    """Knows its open connections and the requests in progress, so that closing can let
    transfers finish and then cut what is left."""

    daemon_threads = True
    block_on_close = False

    def __init__(
        self, address: tuple[str, int], reads: BlobReads, tls: ssl.SSLContext | None
    ) -> None:
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, _Handler)
        self.reads = reads
        self._tls = tls
        self._lock = threading.Condition()
        self._connections: set[socket.socket] = set()
        self._busy = 0

    def finish_request(self, request: Any, client_address: Any) -> None:
        if self._tls is not None:  # the handshake runs here, in the connection's thread
            request.settimeout(_IDLE_SECONDS)  # a client that never says hello lets go
            request = self._tls.wrap_socket(request, server_side=True)
        super().finish_request(request, client_address)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client gone mid-transfer (a load cancelled, a connection cut, a failed TLS
        # handshake) is routine: one line, not the stdlib's traceback on stderr.
        error = sys.exc_info()[1]
        if isinstance(error, OSError):
            log_event(log, "blob_http_connection_lost", client=client_address[0], error=repr(error))
        else:
            log_event(log, "blob_http_internal_error", logging.ERROR, exc_info=True)

    def track(self, connection: socket.socket, open_: bool) -> None:
        with self._lock:
            if open_:
                self._connections.add(connection)
            else:
                self._connections.discard(connection)

    def busy(self) -> _Busy:
        return _Busy(self)

    def enter(self) -> None:
        with self._lock:
            self._busy += 1

    def leave(self) -> None:
        with self._lock:
            self._busy -= 1
            self._lock.notify_all()

    def close_connections(self, grace_seconds: float) -> None:
        """Waits up to ``grace_seconds`` for requests in progress, then shuts every
        connection down (idle keep-alive ones at once: their clients reconnect)."""
        with self._lock:
            self._lock.wait_for(lambda: self._busy == 0, grace_seconds)
            connections = list(self._connections)
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)


class _Busy:
    def __init__(self, server: _Server) -> None:
        self._server = server

    def __enter__(self) -> None:
        self._server.enter()

    def __exit__(self, *exc: object) -> None:
        self._server.leave()


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
    ) -> None:
        host, _, port = listen.rpartition(":")
        self._server = _Server((host.strip("[]"), int(port)), BlobReads(blobs, signer), tls)
        self._host = host
        self._tls = tls
        self._grace = grace_seconds
        self.urls = UrlMaker(signer, public_url or self.default_base_url())
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="blob-http", daemon=True
        )

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

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
        log_event(log, "blob_http_started", address=f"{self._host}:{self.port}")

    def close(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()  # the accept loop ends: no new connections
        self._server.server_close()
        self._server.close_connections(self._grace)
