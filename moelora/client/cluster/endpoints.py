"""Where executor addresses come from: static ``host:port`` entries, or ``dns:///name:port``
names (a Kubernetes headless Service) re-resolved to every address behind them."""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable, Iterable

from moelora.client.logs import log_event

log = logging.getLogger(__name__)

DNS_PREFIX = "dns:///"

#: (host, port) -> the IP addresses behind the name; raises OSError when it does not resolve.
Resolver = Callable[[str, int], list[str]]


def system_resolver(host: str, port: int) -> list[str]:
    """Every address the system resolver gives for ``host`` (A and AAAA records)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


def split_host_port(text: str) -> tuple[str, int]:
    """``name:port`` or ``[v6]:port`` -> (host, port); ValueError otherwise."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"endpoint {text!r} is not host:port (or dns:///host:port)")
    return host.strip("[]"), int(port)


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def resolve_endpoints(endpoints: Iterable[str], resolver: Resolver) -> list[str]:
    """The gRPC addresses of ``endpoints`` now, sorted and without duplicates. A DNS name
    that does not resolve (a headless Service without ready pods) contributes nothing."""
    addresses: set[str] = set()
    for endpoint in endpoints:
        if not endpoint.startswith(DNS_PREFIX):
            split_host_port(endpoint)  # a typo fails here, not at the first call
            addresses.add(endpoint)
            continue
        host, port = split_host_port(endpoint.removeprefix(DNS_PREFIX))
        try:
            found = resolver(host, port)
        except OSError as exc:
            log_event(log, "cluster_dns_failed", logging.WARNING, name=host, error=str(exc))
            continue
        addresses.update(join_host_port(ip, port) for ip in found)
    return sorted(addresses)
