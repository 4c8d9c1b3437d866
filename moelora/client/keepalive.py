"""HTTP/2 keepalive, both sides of it, in one place so that they agree.

A TCP connection that dies without a FIN or RST (a node powered off, a network partition, a
NAT that forgot it) looks idle, not broken: without keepalive a stream over it waits forever.
A client pings while a call is open and no frame has come for ``keepalive_seconds``, and closes
the connection when the ping is not answered within as long again, failing its calls
UNAVAILABLE. A server accepts such pings as often as every ``MIN_CLIENT_PING_SECONDS`` (gRPC's
default policy answers a client that pings more often than every 5 minutes without data with
GOAWAY), and pings its own clients, so that a stream whose client vanished (a watch, a
ForwardStream) frees its worker thread.
"""

from __future__ import annotations

#: A client's default: a dead connection is noticed within twice this.
DEFAULT_KEEPALIVE_SECONDS = 20.0
#: The shortest client keepalive a server accepts.
MIN_CLIENT_PING_SECONDS = 1.0
#: How often a server pings a client, and how long it waits for the answer.
SERVER_PING_SECONDS = 60.0
SERVER_PING_TIMEOUT_SECONDS = 20.0


def client_options(keepalive_seconds: float) -> list[tuple[str, int]]:
    """Channel options of a client that pings every ``keepalive_seconds`` while a call is open
    (at least ``MIN_CLIENT_PING_SECONDS``)."""
    if keepalive_seconds < MIN_CLIENT_PING_SECONDS:
        raise ValueError(
            f"keepalive_seconds: {keepalive_seconds} is below the {MIN_CLIENT_PING_SECONDS} s "
            "that servers accept"
        )
    ms = round(keepalive_seconds * 1000)
    return [
        ("grpc.keepalive_time_ms", ms),
        ("grpc.keepalive_timeout_ms", ms),
        # gRPC core (1.85) waits for a keepalive ping's answer this long, not the above.
        ("grpc.http2.ping_timeout_ms", ms),
        # Pings go on while a stream sends nothing (a quiet watch, a stalled download).
        ("grpc.http2.max_pings_without_data", 0),
    ]


def server_options() -> list[tuple[str, int]]:
    """Server options: clients' pings accepted down to ``MIN_CLIENT_PING_SECONDS`` apart, the
    server's own pings every ``SERVER_PING_SECONDS``."""
    min_ping_ms = round(MIN_CLIENT_PING_SECONDS * 1000)
    return [
        ("grpc.http2.min_ping_interval_without_data_ms", min_ping_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.keepalive_time_ms", round(SERVER_PING_SECONDS * 1000)),
        ("grpc.keepalive_timeout_ms", round(SERVER_PING_TIMEOUT_SECONDS * 1000)),
        ("grpc.http2.ping_timeout_ms", round(SERVER_PING_TIMEOUT_SECONDS * 1000)),
    ]
