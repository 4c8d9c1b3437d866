"""The gRPC server both services run: health, reflection, error mapping, RPC
metrics, message-size limits, TLS, and a drain on SIGTERM; every call passes the limits of
``shared.call_limits`` (authentication on metadata, lanes, per-peer limits, message deadlines,
revocation) first.

A service builds a ``GrpcServer``, registers its servicers through ``register``
and calls ``serve_forever``. Domain errors raised by handlers become status codes
here, so handlers stay thin.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from moelora.client import keepalive
from moelora.client.errors import RETRY_AFTER_METADATA, MoeLoraError, Overloaded
from moelora.client.logs import internal_error_message, log_event
from shared import rpc_metrics
from shared.call_limits import OPEN_PREFIXES, Admission, CallAuthorizer, CallLimits, Lane
from shared.reflection import enable_reflection
from shared.rpc_metrics import MethodMetrics

log = logging.getLogger(__name__)

#: After a drain, how long calls already answered get to send their statuses before the
#: server stops and cancels what is left.
STATUS_FLUSH_SECONDS = 1.0


@dataclass(frozen=True)
class ServerOptions:
    """How to listen and how to stop."""

    listen: str
    max_message_bytes: int = 64 * 1024 * 1024
    max_workers: int = 16
    drain_seconds: float = 30.0
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    limits: CallLimits = field(default_factory=CallLimits)
    #: Share the port with other processes' servers (SO_REUSEPORT: the kernel spreads new
    #: connections over them).
    reuse_port: bool = False


class _State:
    """Whether new RPCs are taken (shared by the server and its interceptor)."""

    def __init__(self) -> None:
        self.draining = threading.Event()
        #: Why the server drains, for the UNAVAILABLE that new calls get.
        self.drain_reason = "server is draining"
        self._idle = threading.Condition()
        self._in_flight = 0

    def enter(self) -> None:
        with self._idle:
            self._in_flight += 1

    def leave(self) -> None:
        with self._idle:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """Waits until no counted RPC is in flight; False if ``timeout`` passed first."""
        with self._idle:
            return self._idle.wait_for(lambda: self._in_flight == 0, timeout)


class _Call:
    """Around one RPC: refuses it while draining, counts it in flight, maps its errors to
    status codes and records its metrics."""

    def __init__(self, method: str, metrics: MethodMetrics, state: _State, counted: bool) -> None:
        self.method = method
        self.metrics = metrics
        self._state = state
        self._counted = counted

    @contextlib.contextmanager
    def handled(self, context: grpc.ServicerContext) -> Iterator[None]:
        start = self.metrics.started()
        code = grpc.StatusCode.OK
        entered = False
        try:
            if self._counted and self._state.draining.is_set():
                context.abort(
                    grpc.StatusCode.UNAVAILABLE,
                    f"{self._state.drain_reason}; retry on another replica",
                )
            if self._counted:
                self._state.enter()
                entered = True
            yield
            code = context.code() or grpc.StatusCode.OK
        except GeneratorExit:  # the client went away from a stream
            code = grpc.StatusCode.CANCELLED
            raise
        except Exception as exc:
            if not _is_abort(exc, context):
                code, message = self._failure(context, exc)
                context.abort(code, message)
            code = context.code()
            raise
        finally:
            if entered:
                self._state.leave()
            self.metrics.handled(start, code)

    def _requests(self, requests: Iterator[Any]) -> Iterator[Any]:
        for request in requests:
            self.metrics.received()
            yield request

    def unary(self, behavior: Callable[..., Any], streamed: bool) -> Callable[..., Any]:
        def run(request: Any, context: grpc.ServicerContext) -> Any:
            with self.handled(context):
                if streamed:
                    request = self._requests(request)
                else:
                    self.metrics.received()
                response = behavior(request, context)
            self.metrics.sent()
            return response

        return run

    def stream(
        self, behavior: Callable[..., Iterator[Any]], streamed: bool
    ) -> Callable[..., Iterator[Any]]:
        def run(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            with self.handled(context):
                if streamed:
                    request = self._requests(request)
                else:
                    self.metrics.received()
                for response in behavior(request, context):
                    self.metrics.sent()
                    yield response

        return run

    def _failure(
        self, context: grpc.ServicerContext, exc: BaseException
    ) -> tuple[grpc.StatusCode, str]:
        """The status code and message ``exc`` ends the RPC with."""
        if isinstance(exc, MoeLoraError):
            if isinstance(exc, Overloaded):
                context.set_trailing_metadata(((RETRY_AFTER_METADATA, str(exc.retry_after_ms)),))
            return exc.code, exc.message
        if isinstance(exc, NotImplementedError):
            return grpc.StatusCode.UNIMPLEMENTED, f"{self.method} is not implemented in this build"
        return grpc.StatusCode.INTERNAL, internal_error_message(
            "rpc_internal_error", method=self.method
        )


class _ErrorAndMetricsInterceptor(grpc.ServerInterceptor):  # type: ignore[misc]
    """Wraps every handler in a ``_Call`` (see there)."""

    def __init__(self, state: _State) -> None:
        self._state = state

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        handler = continuation(details)
        if handler is None:
            return None
        method: str = details.method
        # Health and reflection are answered during a drain and don't hold it up.
        counted = not method.startswith(OPEN_PREFIXES)
        metrics = MethodMetrics.of(method, handler.request_streaming, handler.response_streaming)
        call = _Call(method, metrics, self._state, counted)
        des, ser = handler.request_deserializer, handler.response_serializer
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                call.unary(handler.unary_unary, False), des, ser
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                call.stream(handler.unary_stream, False), des, ser
            )
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                call.unary(handler.stream_unary, True), des, ser
            )
        return grpc.stream_stream_rpc_method_handler(
            call.stream(handler.stream_stream, True), des, ser
        )


def _is_abort(exc: Exception, context: grpc.ServicerContext) -> bool:
    # context.abort() raises a bare Exception after setting the status code.
    return type(exc) is Exception and context.code() not in (None, grpc.StatusCode.OK)


class GrpcServer:
    """One gRPC server with health and reflection for ``service_names``."""

    def __init__(
        self,
        options: ServerOptions,
        service_names: Sequence[str],
        register: Callable[[grpc.Server], None],
        authorizer: CallAuthorizer | None = None,
        lanes: Sequence[Lane] = (),
    ) -> None:
        """``authorizer`` decides on every call but health and reflection, on its metadata;
        ``lanes`` give methods threads of their own (see ``shared.call_limits``)."""
        self.options = options
        self._state = _State()
        self._stopped = threading.Event()
        self._service_names = list(service_names)
        self._admission = Admission(options.limits, options.max_workers, authorizer, lanes)
        self._drain_listeners: list[Callable[[], None]] = []
        limit = options.max_message_bytes
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=options.max_workers, thread_name_prefix="grpc"),
            interceptors=[self._admission.interceptor, _ErrorAndMetricsInterceptor(self._state)],
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit),
                ("grpc.so_reuseport", int(options.reuse_port)),
                *keepalive.server_options(),
            ],
        )
        self.health = health.HealthServicer(experimental_non_blocking=True)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        register(self._server)
        enable_reflection([*self._service_names, health.SERVICE_NAME], self._server)
        self.port = self._bind()
        self.set_serving(False)

    def _bind(self) -> int:
        opts = self.options
        try:
            if opts.tls_cert_file and opts.tls_key_file:
                creds = grpc.ssl_server_credentials(
                    [(opts.tls_key_file.read_bytes(), opts.tls_cert_file.read_bytes())]
                )
                port = int(self._server.add_secure_port(opts.listen, creds))
            else:
                port = int(self._server.add_insecure_port(opts.listen))
        except RuntimeError:  # grpc names no cause: shared.startup.check_listen does
            port = 0
        if port == 0:
            raise OSError(f"cannot listen on {opts.listen}")
        return port

    @property
    def address(self) -> str:
        host = self.options.listen.rsplit(":", 1)[0]
        return f"{host}:{self.port}"

    @property
    def draining(self) -> bool:
        return self._state.draining.is_set()

    def set_serving(self, serving: bool) -> None:
        """Health status of the server ("") and of each service."""
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ["", *self._service_names]:
            self.health.set(name, status)
        for name in self._service_names:
            rpc_metrics.set_serving(name, serving)

    def start(self) -> None:
        self._server.start()
        log_event(log, "server_started", address=self.address, services=self._service_names)

    @property
    def drain_event(self) -> threading.Event:
        """Set once the drain starts: long-lived streams watch it to end themselves."""
        return self._state.draining

    def on_drain(self, listener: Callable[[], None]) -> None:
        """Calls ``listener`` when the drain starts (to wake streams that wait)."""
        self._drain_listeners.append(listener)

    def drain(
        self,
        on_drained: Callable[[], None] | None = None,
        *,
        grace: float | None = None,
        reason: str | None = None,
        linger: float = 0.0,
    ) -> None:
        """Stops taking new RPCs (they get UNAVAILABLE, which clients retry elsewhere,
        with ``reason`` in its message), reports NOT_SERVING, lets RPCs in flight finish for
        up to ``grace`` (default ``drain_seconds``) and keeps answering new ones so for at
        least ``linger`` seconds, then stops, cancelling what is still running. Idempotent."""
        if self._state.draining.is_set():
            return
        if reason is not None:
            self._state.drain_reason = reason
        self._state.draining.set()
        self.set_serving(False)
        for listener in self._drain_listeners:
            listener()
        grace = self.options.drain_seconds if grace is None else grace
        log_event(log, "server_draining", grace_seconds=grace)
        started = time.monotonic()
        idle = self._state.wait_idle(grace)
        if not idle:
            log_event(log, "drain_timeout", logging.WARNING, grace_seconds=grace)
        time.sleep(max(0.0, linger - (time.monotonic() - started)))
        # A call whose handler has just returned may still be sending its status; stop(0)
        # would cancel it, and its client would see "Cancelling all calls", not the answer.
        self._server.stop(STATUS_FLUSH_SECONDS).wait()
        self._admission.close()
        if on_drained is not None:
            on_drained()
        log_event(log, "server_stopped")
        self._stopped.set()

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until the server stopped; True if it did."""
        return self._stopped.wait(timeout)

    def serve_forever(
        self,
        on_drained: Callable[[], None] | None = None,
        on_started: Callable[[], None] | None = None,
    ) -> None:
        """Starts, calls ``on_started``, drains on SIGTERM or SIGINT, returns once stopped."""
        self.start()

        def handle(signum: int, _frame: Any) -> None:
            log_event(log, "signal_received", signal=signal.Signals(signum).name)
            threading.Thread(
                target=self.drain, args=(on_drained,), name="drain", daemon=True
            ).start()

        signal.signal(signal.SIGTERM, handle)
        signal.signal(signal.SIGINT, handle)
        if on_started is not None:
            on_started()
        while not self.wait(0.5):
            pass


__all__ = [
    "GrpcServer",
    "ServerOptions",
    "internal_error_message",
]
