"""What a failed Forward means to the cluster clients' router: the replica's fault (fail over
and eject it) or the request's (the caller gets the error)."""

from __future__ import annotations

import grpc
import pytest

from moelora.client.cluster.router import ClusterSettings, Router
from moelora.client.errors import error_for_code


def _router() -> Router:
    return Router(ClusterSettings(), ["127.0.0.1:1"], lambda host, port: [f"{host}:{port}"])


@pytest.mark.parametrize(
    "code",
    # CANCELLED reaches a caller when the replica's server stops with the call queued.
    [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED],
)
def test_a_replica_that_went_away_is_failed_over(code: grpc.StatusCode) -> None:
    router = _router()
    assert router.failed("127.0.0.1:1", error_for_code(code, "gone"))
    assert router.stats().failovers == 1


@pytest.mark.parametrize(
    "code",
    [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INTERNAL],
)
def test_a_bad_request_is_not_failed_over(code: grpc.StatusCode) -> None:
    router = _router()
    assert not router.failed("127.0.0.1:1", error_for_code(code, "bad"))
    assert router.stats().failovers == 0
