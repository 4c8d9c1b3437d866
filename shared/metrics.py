"""The Prometheus /metrics endpoint, and the series every service exports besides its own:
``moelora_build_info``, the process collector's ``process_*`` and the gRPC server's
(shared/rpc_metrics.py)."""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import REGISTRY, CollectorRegistry, Info, disable_created_metrics
from prometheus_client.exposition import ThreadingWSGIServer, make_wsgi_app

from moelora.client.logs import log_event
from shared.version import package_version, source_commit

log = logging.getLogger(__name__)

#: The one path served; anything else is 404, so that a probe pointed at the wrong path fails.
METRICS_PATH = "/metrics"

StartResponse = Callable[[str, list[tuple[str, str]]], Any]


def export_build_info(registry: CollectorRegistry = REGISTRY) -> None:
    """``moelora_build_info{version, commit} 1``: join it on to say which build a pod runs."""
    info = Info("moelora_build", "The running moe-lora-serve build", registry=registry)
    info.info({"version": package_version(), "commit": source_commit()})


def metrics_app(registry: CollectorRegistry = REGISTRY) -> Callable[..., Iterable[bytes]]:
    """A WSGI app serving ``registry`` at /metrics and 404 elsewhere."""
    metrics = make_wsgi_app(registry)

    def app(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        if environ.get("PATH_INFO") == METRICS_PATH:
            return metrics(environ, start_response)  # type: ignore[no-any-return]
        start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
        return [f"not found: metrics are at {METRICS_PATH}\n".encode()]

    return app


class _Server6(ThreadingWSGIServer):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    """Scrapes are not logged: one line per scrape would drown the events."""

    def log_message(self, format: str, *args: Any) -> None:
        pass


def start_metrics_server(listen: str, registry: CollectorRegistry = REGISTRY) -> int | None:
    """Serves /metrics on ``host:port`` in a daemon thread and exports the build info;
    returns the port, or None when ``listen`` is empty (metrics off). ``_created`` series are
    off: they double every counter's series and nothing reads them. Raises OSError when the
    address cannot be bound."""
    if not listen:
        return None
    disable_created_metrics()  # type: ignore[no-untyped-call]
    export_build_info(registry)
    host, _, port = listen.rpartition(":")
    address = host.strip("[]") or "0.0.0.0"
    server_class: type[WSGIServer] = _Server6 if ":" in address else ThreadingWSGIServer
    server = make_server(
        address, int(port), metrics_app(registry), server_class, handler_class=_QuietHandler
    )
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    bound = int(server.server_port)
    log_event(log, "metrics_started", address=f"{host}:{bound}", path=METRICS_PATH)
    return bound
