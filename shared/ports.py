"""Free loopback ports for servers that tests and benchmarks start as child processes."""

from __future__ import annotations

import itertools
import random
import socket
from pathlib import Path

# Linux hands outgoing connections (and bind to port 0) local ports from this range. A port
# taken from it and released could be the local end of some other connection by the time
# the child process binds it; ports below it are only ever bound on purpose.
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 10_000
# One walk per process, from a random start, so that the ports one process hands out differ
# even before their servers bind them, and two processes seldom meet.
_walk = itertools.count(random.randrange(1 << 16))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, and that no outgoing
    connection can take before the caller's server binds it."""
    try:
        ephemeral_low = int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 0
    span = ephemeral_low - _LOWEST
    if span < 1000:  # no room below the ephemeral range: let the kernel choose
        return _bound_port(0)
    for _ in range(span):
        port = _LOWEST + next(_walk) % span
        try:
            return _bound_port(port)
        except OSError:
            continue
    raise OSError(f"no free port in {_LOWEST}..{ephemeral_low - 1}")


def _bound_port(port: int) -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
        return int(sock.getsockname()[1])
