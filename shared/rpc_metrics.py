"""gRPC server metrics under the names and labels the gRPC ecosystem's dashboards and alerts
read: those of go-grpc-prometheus and py-grpc-prometheus (``grpc_server_started_total``,
``grpc_server_handled_total``, ``grpc_server_msg_received_total``,
``grpc_server_msg_sent_total``, ``grpc_server_handling_seconds``; labels ``grpc_type``,
``grpc_service``, ``grpc_method`` and ``grpc_code``, the status code's name as grpc-python
spells it: ``OK``, ``NOT_FOUND``, ...).

``grpc_server_handling_seconds`` times RPCs that answer once (unary and client-streaming: the
time a caller waits for its answer). Streams that answer many times (server-streaming and
bidi: a watch, a ForwardStream) live for minutes or days; their lifetimes go to
``moelora_grpc_server_stream_seconds`` with buckets of their own, so that they never fill the
latency histogram's top bucket. docs/decisions/0002-grpc-metric-names.md says why these names.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import grpc
from prometheus_client import Counter, Gauge, Histogram

_LABELS = ("grpc_type", "grpc_service", "grpc_method")

_STARTED = Counter(
    "grpc_server_started_total", "Total number of RPCs started on the server.", _LABELS
)
_HANDLED = Counter(
    "grpc_server_handled_total",
    "Total number of RPCs completed on the server, regardless of success or failure.",
    [*_LABELS, "grpc_code"],
)
_RECEIVED = Counter(
    "grpc_server_msg_received_total",
    "Total number of RPC stream messages received on the server.",
    _LABELS,
)
_SENT = Counter(
    "grpc_server_msg_sent_total",
    "Total number of gRPC stream messages sent by the server.",
    _LABELS,
)
_HANDLING = Histogram(
    "grpc_server_handling_seconds",
    "Histogram of response latency (seconds) of gRPC that had been application-level handled "
    "by the server (RPCs with one response: unary and client_stream).",
    _LABELS,
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
_STREAM = Histogram(
    "moelora_grpc_server_stream_seconds",
    "Lifetime of RPCs with streamed responses (server_stream, bidi_stream), start to close",
    _LABELS,
    buckets=(0.1, 1, 10, 60, 300, 900, 3600, 4 * 3600, 12 * 3600, 24 * 3600, 7 * 24 * 3600),
)
_SERVING = Gauge(
    "moelora_grpc_server_serving",
    "1 while the server's health check reports SERVING for the service, else 0",
    ["grpc_service"],
    # Several front-end processes of one executor: serving if any live one is.
    multiprocess_mode="livemax",
)


def rpc_type(request_streaming: bool, response_streaming: bool) -> str:
    """``grpc_type``: unary, client_stream, server_stream or bidi_stream."""
    if request_streaming:
        return "bidi_stream" if response_streaming else "client_stream"
    return "server_stream" if response_streaming else "unary"


def split_method(full_method: str) -> tuple[str, str]:
    """``/moelora.v1.Executor/Forward`` -> (``moelora.v1.Executor``, ``Forward``)."""
    service, _, method = full_method.lstrip("/").rpartition("/")
    return service or "unknown", method


@dataclass(frozen=True)
class MethodMetrics:
    """The series of one method, label children resolved once (``labels()`` is not free)."""

    grpc_type: str
    grpc_service: str
    grpc_method: str

    @classmethod
    def of(
        cls, full_method: str, request_streaming: bool, response_streaming: bool
    ) -> MethodMetrics:
        return cls(rpc_type(request_streaming, response_streaming), *split_method(full_method))

    @property
    def _labels(self) -> tuple[str, str, str]:
        return (self.grpc_type, self.grpc_service, self.grpc_method)

    @property
    def streams_responses(self) -> bool:
        return self.grpc_type in ("server_stream", "bidi_stream")

    def started(self) -> float:
        """Counts the RPC as started; returns its start time for ``handled``."""
        _STARTED.labels(*self._labels).inc()
        return time.perf_counter()

    def received(self) -> None:
        _RECEIVED.labels(*self._labels).inc()

    def sent(self) -> None:
        _SENT.labels(*self._labels).inc()

    def handled(self, start: float, code: grpc.StatusCode) -> None:
        """Counts the RPC as completed with ``code`` and records how long it took."""
        _HANDLED.labels(*self._labels, code.name).inc()
        took = time.perf_counter() - start
        (_STREAM if self.streams_responses else _HANDLING).labels(*self._labels).observe(took)


def set_serving(service: str, serving: bool) -> None:
    """What health reports for ``service``."""
    _SERVING.labels(service).set(1 if serving else 0)
