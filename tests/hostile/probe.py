"""The health probe loop of ``conftest.HealthWatch``, in a module that imports only grpc and
the client's health call: a spawned probe process starts in a moment."""

from __future__ import annotations

import time
from typing import Any

import grpc

from moelora.client.health import health_check

#: How long health may take to answer while a service is attacked.
HEALTH_BOUND_SECONDS = 1.0


def probe(address: str, interval: float, stop: Any, answers: Any) -> None:
    """HealthWatch's probe loop, in a process of its own: (seconds, failure or "") each."""
    stopping = False
    while True:  # until stopped, and once more after that (a probe after the attack)
        start = time.monotonic()
        failure = ""
        try:
            with grpc.insecure_channel(address) as channel:
                status = health_check(channel, timeout=HEALTH_BOUND_SECONDS * 3)
            if status != "SERVING":
                failure = status
        except grpc.RpcError as exc:
            failure = exc.code().name if isinstance(exc, grpc.Call) else "?"
        answers.put((time.monotonic() - start, failure))
        if stopping:
            return
        stopping = stop.wait(interval)
