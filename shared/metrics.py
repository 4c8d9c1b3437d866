"""The Prometheus /metrics endpoint."""

from __future__ import annotations

import logging

from prometheus_client import start_http_server

from shared.logs import log_event

log = logging.getLogger(__name__)


def start_metrics_server(listen: str) -> int | None:
    """Serves /metrics on ``host:port`` in a daemon thread; returns the port, or
    None when ``listen`` is empty (metrics off)."""
    if not listen:
        return None
    host, _, port = listen.rpartition(":")
    server, _thread = start_http_server(int(port), addr=host.strip("[]") or "0.0.0.0")
    bound = int(server.server_port)
    log_event(log, "metrics_started", address=f"{host}:{bound}")
    return bound
