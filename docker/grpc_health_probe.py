#!/usr/bin/env python3
"""Container health probe: exits 0 when every ADDRESS answers SERVING on grpc.health.v1.

Used by the images' HEALTHCHECK (no address: the server this container runs, from
MOELORA_REGISTRY_LISTEN or MOELORA_EXECUTOR_LISTEN with a wildcard host replaced by
loopback) and by the chart's `helm test` pod (the registry and every executor by DNS name).
It ships in the images as /opt/moelora/grpc_health_probe.py, so no probe binary is downloaded.

Exit codes: 0 all SERVING, 1 any other status or no answer, 2 bad usage.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import grpc

from moelora.client.health import health_check

WILDCARD_HOSTS = ("", "0.0.0.0", "[::]", "::")


#: Where the server's listen address is, by service (the first set wins; the last is the name
#: from before the per-service prefixes).
LISTEN_VARIABLES = ("MOELORA_REGISTRY_LISTEN", "MOELORA_EXECUTOR_LISTEN", "MOELORA_LISTEN")


def own_address(environ: dict[str, str]) -> str:
    """The loopback address of the server whose listen variable is in ``environ``."""
    name = next((n for n in LISTEN_VARIABLES if environ.get(n)), LISTEN_VARIABLES[0])
    listen = environ.get(name, "")
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit():
        raise SystemExit(f"grpc_health_probe: {name}={listen!r} is not host:port")
    if host in WILDCARD_HOSTS:
        host = "127.0.0.1"
    return f"{host}:{port}"


def probe(address: str, service: str, timeout: float) -> str:
    """The health status name of ``service`` at ``address``, or why there is none."""
    with grpc.insecure_channel(address) as channel:
        try:
            return health_check(channel, service, timeout=timeout)
        except grpc.RpcError as exc:
            if isinstance(exc, grpc.Call):
                return f"{exc.code().name}: {exc.details()}"
            return str(exc)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "addresses", nargs="*", metavar="ADDRESS", help="host:port; default: this container's"
    )
    parser.add_argument(
        "--service", default="", help="health service name; default: the whole server"
    )
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds per check")
    args = parser.parse_args(argv)
    addresses = args.addresses or [own_address(dict(os.environ))]
    healthy = True
    for address in addresses:
        status = probe(address, args.service, args.timeout)
        print(f"{address} {args.service or '(server)'}: {status}", flush=True)
        healthy = healthy and status == "SERVING"
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
