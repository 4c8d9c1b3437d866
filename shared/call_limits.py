"""What a caller may hold of a gRPC server, decided before a handler thread waits on it.

grpc-python's thread-pool server parks a worker thread on a call until its request message
arrives, before any handler code runs: a few dozen calls that never send their message take
every thread, health checks included. So every call passes through ``Admission`` first, in the
server's polling thread, where only its metadata exists:

* **Authentication on metadata.** A call without a valid token (or whose token's role is too
  low) is refused at once, before a byte of its body is read: a token-less 500 MiB Forward
  costs the server its headers.
* **Lanes.** Health and reflection run on threads of their own (``HEALTH_WORKERS``), so that no
  other call can starve them; a service may give a method a lane of its own (the registry's
  watches). Every other call counts against ``max_concurrent_rpcs`` (running or waiting for a
  thread); past it, RESOURCE_EXHAUSTED with a retry hint, answered by a refusal thread.
* **Per-peer limits for callers without a token** (every caller while auth is off; health and
  reflection always): ``max_calls_per_peer`` calls of one client address at once, of which
  ``HEALTH_CALLS_PER_PEER`` on the health lane.
* **Message deadlines.** A call's request message (a request stream's first one) must arrive
  within ``message_timeout_seconds`` (health and reflection: ``HEALTH_MESSAGE_SECONDS``); a call
  still waiting then ends with DEADLINE_EXCEEDED and frees its thread.
* **Revocation.** Open streams are checked against the token file every ``RECHECK_SECONDS``: a
  stream whose token was revoked (or lost the role its method needs) ends with UNAUTHENTICATED
  (PERMISSION_DENIED).
* **Request bytes are parsed here**, so that malformed protobuf is INVALID_ARGUMENT rather than
  grpc's INTERNAL "Exception deserializing request!".

Every server built by ``shared.grpc_server.GrpcServer`` has all of this, however many run (one
process, or several on one port with SO_REUSEPORT: each process counts its own calls).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections import Counter as Tally
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
from google.protobuf.message import DecodeError
from grpc._cython import cygrpc
from prometheus_client import Counter

from moelora.client.errors import RETRY_AFTER_METADATA, InvalidArgument, MoeLoraError
from moelora.client.logs import internal_error_message, log_event
from shared.rpc_metrics import split_method

log = logging.getLogger(__name__)

REFUSED = Counter(
    "moelora_grpc_server_refused_total",
    "Calls refused or ended by the server's limits outside their handler, by method and "
    "reason (unauthenticated, permission_denied, overloaded, peer_limit, message_timeout, "
    "revoked, malformed, internal)",
    ["grpc_service", "grpc_method", "reason"],
)


def _refused(full_method: str, reason: str) -> None:
    REFUSED.labels(*split_method(full_method), reason).inc()


#: Methods every caller may use without a token; they run on the health lane.
OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
#: Threads that serve health and reflection, apart from every other call.
HEALTH_WORKERS = 16
#: Health and reflection calls one client address may have open at once.
HEALTH_CALLS_PER_PEER = 4
#: Health and reflection streams (Watch, ServerReflectionInfo) open at once, all callers
#: together: the other half of the health threads always answers Check.
HEALTH_STREAMS = HEALTH_WORKERS // 2
#: How long the request message of a health or reflection call may take (a few bytes).
HEALTH_MESSAGE_SECONDS = 1.0
#: Threads that answer refusals (each takes microseconds).
REFUSAL_WORKERS = 2
#: How often open streams are checked against the token file.
RECHECK_SECONDS = 1.0
#: The retry hint sent with RESOURCE_EXHAUSTED.
RETRY_AFTER_MS = 1000

Metadata = Sequence[tuple[str, str | bytes]]


class Caller(Protocol):
    """Who a call's metadata says is calling, as far as the limits care."""

    @property
    def has_token(self) -> bool:
        """True when the caller proved a token (False: auth is off)."""
        ...


class CallAuthorizer(Protocol):
    """The server's auth hook: decides on metadata alone."""

    def authorize(self, method: str, metadata: Metadata) -> Caller:
        """The caller, or a MoeLoraError (Unauthenticated, PermissionDenied) refusing it."""
        ...

    def still_authorized(self, method: str, caller: Caller) -> MoeLoraError | None:
        """Checks an open call again against the current tokens: the error that ends it, or
        None while it may go on."""
        ...


@dataclass(frozen=True)
class CallLimits:
    """A server's limits; see the module docstring."""

    #: Calls admitted at once outside the health lane and the services' own lanes (running or
    #: waiting for a worker thread); 0: four per worker thread.
    max_concurrent_rpcs: int = 0
    #: Calls without a token from one client address open at once.
    max_calls_per_peer: int = 64
    #: How long a call's request message (a request stream's first one) may take to arrive.
    message_timeout_seconds: float = 5.0


@dataclass(frozen=True)
class Lane:
    """Methods served by ``workers`` threads of their own, at most ``max_calls`` at once; past
    that RESOURCE_EXHAUSTED with ``refusal`` (which says why and what to do)."""

    name: str
    methods: frozenset[str]
    workers: int
    max_calls: int
    refusal: str


@dataclass
class _LaneState:
    pool: futures.ThreadPoolExecutor | None  # None: the server's own worker threads
    max_calls: int  # 0: no limit
    refusal: str
    calls: int = 0
    streams: int = 0


@dataclass
class _Pending:
    """A call whose (first) request message has not arrived yet. Its context is let go once
    the message came: the watchdog's heap keeps entries until their deadline, and a busy
    server must not keep thousands of finished calls alive that long."""

    context: grpc.ServicerContext | None
    method: str
    seconds: float


@dataclass(eq=False)
class _OpenStream:
    method: str
    caller: Caller
    context: grpc.ServicerContext


def end_call(context: grpc.ServicerContext, code: grpc.StatusCode, message: str) -> None:
    """Ends a call from any thread with ``code`` and ``message``: ``context.abort`` works only in
    the call's own thread and ``context.cancel`` says only CANCELLED. A handler thread blocked
    on the call wakes with an RpcError. (grpc-python's server context keeps its core call in
    ``_rpc_event``; tests/hostile/test_revocation.py pins that this still works.)"""
    call = getattr(getattr(context, "_rpc_event", None), "call", None)
    if call is None:
        context.cancel()
        return
    call.cancel(cygrpc.StatusCode(code.value[0]), message)


def peer_address(peer: str) -> str:
    """The client address in ``context.peer()``: "ipv4:10.0.0.7:51234" -> "10.0.0.7"."""
    kind, _, rest = peer.partition(":")
    if kind in ("ipv4", "ipv6"):
        return rest.rpartition(":")[0].strip("[]")
    return kind


def _reason(code: grpc.StatusCode) -> str:
    return code.name.lower() if code is not grpc.StatusCode.RESOURCE_EXHAUSTED else "overloaded"


class Admission:
    """The limits of one server (see the module docstring): ``interceptor`` goes first in the
    server's interceptor list; ``close`` stops the threads this made."""

    def __init__(
        self,
        limits: CallLimits,
        workers: int,
        authorizer: CallAuthorizer | None,
        lanes: Sequence[Lane] = (),
    ) -> None:
        self._limits = limits
        self._authorizer = authorizer
        self._lock = threading.Condition()
        self._pools: list[futures.ThreadPoolExecutor] = []
        cap = limits.max_concurrent_rpcs or 4 * workers
        self._main = _LaneState(
            None,
            cap,
            f"{cap} calls are in progress, the most this server takes at once "
            "(--max-concurrent-rpcs); retry shortly or on another replica",
        )
        self._health = _LaneState(self._pool("grpc-health", HEALTH_WORKERS), 0, "")
        self._lanes: dict[str, _LaneState] = {}
        for lane in lanes:
            state = _LaneState(
                self._pool(f"grpc-{lane.name}", lane.workers), lane.max_calls, lane.refusal
            )
            self._lanes.update(dict.fromkeys(lane.methods, state))
        self._refusals = self._pool("grpc-refuse", REFUSAL_WORKERS)
        self._peers: Tally[str] = Tally()
        self._health_peers: Tally[str] = Tally()
        self._streams: set[_OpenStream] = set()
        self._pending: list[tuple[float, int, _Pending]] = []
        self._order = itertools.count()
        self._closed = False
        self._watchdog = threading.Thread(target=self._watch, name="grpc-limits", daemon=True)
        self._watchdog.start()
        self.interceptor: grpc.ServerInterceptor = _AdmissionInterceptor(self)

    def _pool(self, prefix: str, workers: int) -> futures.ThreadPoolExecutor:
        pool = futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix=prefix)
        self._pools.append(pool)
        return pool

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        self._watchdog.join(5)
        for pool in self._pools:
            pool.shutdown(wait=False, cancel_futures=True)

    # -- in the server's polling thread: metadata only ------------------------------------------

    def admit(self, handler: grpc.RpcMethodHandler, method: str, metadata: Metadata) -> Any:
        """The handler grpc runs for this call: ``handler`` behind the limits, or a refusal."""
        open_method = method.startswith(OPEN_PREFIXES)
        lane = self._health if open_method else self._lanes.get(method, self._main)
        caller: Caller | None = None
        if self._authorizer is not None and not open_method:
            try:
                caller = self._authorizer.authorize(method, metadata)
            except MoeLoraError as exc:
                return self.refusal(method, exc.code, exc.message)
        streaming = bool(handler.request_streaming or handler.response_streaming)
        with self._lock:
            if open_method and streaming and lane.streams >= HEALTH_STREAMS:
                refused = f"{HEALTH_STREAMS} health and reflection streams are open; retry later"
            elif lane.max_calls and lane.calls >= lane.max_calls:
                refused = lane.refusal
            else:
                refused = ""
                lane.calls += 1
                lane.streams += streaming
        if refused:
            return self.refusal(method, grpc.StatusCode.RESOURCE_EXHAUSTED, refused)
        tokenless = caller is None or not caller.has_token
        call = _AdmittedCall(self, method, lane, caller, tokenless, streaming, open_method)
        return call.handler(handler)

    def refusal(self, method: str, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
        """A handler that answers ``code`` at once, on a refusal thread, reading nothing."""
        reason = _reason(code)

        def refuse(_requests: Iterator[bytes], context: grpc.ServicerContext) -> None:
            _refused(method, reason)
            if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
                context.set_trailing_metadata(((RETRY_AFTER_METADATA, str(RETRY_AFTER_MS)),))
            context.abort(code, message)

        behavior: Any = refuse
        behavior.experimental_thread_pool = self._refusals
        # Request-streaming: grpc hands the call over without waiting for a message.
        return grpc.stream_unary_rpc_method_handler(behavior)

    # -- in the call's own thread ---------------------------------------------------------------

    def enter_peer(self, peer: str, health: bool) -> str:
        """Counts a call without a token from ``peer``; the refusal when over its limits."""
        with self._lock:
            if health and self._health_peers[peer] >= HEALTH_CALLS_PER_PEER:
                return (
                    f"{HEALTH_CALLS_PER_PEER} health and reflection calls of this client "
                    "address are open, the most one address may have; retry shortly"
                )
            if self._peers[peer] >= self._limits.max_calls_per_peer:
                return (
                    f"{self._limits.max_calls_per_peer} calls without a token from this client "
                    "address are in progress, the most one address may have "
                    "(--max-calls-per-peer); retry shortly"
                )
            self._peers[peer] += 1
            if health:
                self._health_peers[peer] += 1
        return ""

    def leave(self, call: _AdmittedCall) -> None:
        with self._lock:
            call.lane.calls -= 1
            call.lane.streams -= call.streaming
            if call.peer is not None:
                _drop(self._peers, call.peer)
                if call.open_method:
                    _drop(self._health_peers, call.peer)
            if call.stream is not None:
                self._streams.discard(call.stream)

    def track_stream(self, stream: _OpenStream) -> None:
        with self._lock:
            self._streams.add(stream)

    def message_seconds(self, open_method: bool) -> float:
        seconds = self._limits.message_timeout_seconds
        return min(seconds, HEALTH_MESSAGE_SECONDS) if open_method else seconds

    def expect_message(self, pending: _Pending) -> None:
        with self._lock:
            deadline = time.monotonic() + pending.seconds
            wake = not self._pending or deadline < self._pending[0][0]
            heapq.heappush(self._pending, (deadline, next(self._order), pending))
            if wake:
                self._lock.notify_all()

    # -- the watchdog thread --------------------------------------------------------------------

    def _watch(self) -> None:
        recheck_at = time.monotonic() + RECHECK_SECONDS
        while True:
            with self._lock:
                if self._closed:
                    return
                now = time.monotonic()
                late: list[_Pending] = []
                while self._pending and self._pending[0][0] <= now:
                    late.append(heapq.heappop(self._pending)[2])
                streams = list(self._streams) if now >= recheck_at else None
                if not late and streams is None:
                    until = min(recheck_at, self._pending[0][0] if self._pending else recheck_at)
                    self._lock.wait(until - now)
                    continue
            for pending in late:
                context = pending.context  # once: the call's thread may let it go meanwhile
                if context is not None:
                    _refused(pending.method, "message_timeout")
                    end_call(
                        context,
                        grpc.StatusCode.DEADLINE_EXCEEDED,
                        f"the request message did not arrive within {pending.seconds:g} s of "
                        "the call's start (--message-timeout-seconds)",
                    )
            if streams is not None:
                recheck_at = time.monotonic() + RECHECK_SECONDS
                self._recheck(streams)

    def _recheck(self, streams: list[_OpenStream]) -> None:
        if self._authorizer is None:
            return
        for stream in streams:
            try:
                error = self._authorizer.still_authorized(stream.method, stream.caller)
            except Exception:
                log_event(log, "stream_recheck_failed", logging.ERROR, exc_info=True)
                return
            if error is not None:
                _refused(stream.method, "revoked")
                log_event(log, "stream_revoked", method=stream.method, reason=error.message)
                end_call(stream.context, error.code, error.message)


def _drop(tally: Tally[str], key: str) -> None:
    tally[key] -= 1
    if tally[key] <= 0:
        del tally[key]


class _AdmittedCall:
    """One admitted call: runs the service's handler in its lane's threads, takes the request
    bytes itself, and gives back what the call held when it ends."""

    def __init__(
        self,
        admission: Admission,
        method: str,
        lane: _LaneState,
        caller: Caller | None,
        tokenless: bool,
        streaming: bool,
        open_method: bool,
    ) -> None:
        self.admission = admission
        self.method = method
        self.lane = lane
        self.caller = caller
        self.tokenless = tokenless
        self.streaming = streaming
        self.open_method = open_method
        self.peer: str | None = None
        self.stream: _OpenStream | None = None

    def handler(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """``handler`` as a request-streaming handler of raw bytes (grpc waits for nothing)."""
        inner = (
            handler.unary_unary
            or handler.unary_stream
            or handler.stream_unary
            or handler.stream_stream
        )
        behavior: Any = _Behavior(
            self, inner, handler.request_deserializer, handler.request_streaming
        )
        if self.lane.pool is not None:
            behavior.experimental_thread_pool = self.lane.pool
        make = (
            grpc.stream_stream_rpc_method_handler
            if handler.response_streaming
            else grpc.stream_unary_rpc_method_handler
        )
        return make(behavior, None, handler.response_serializer)

    def start(self, context: grpc.ServicerContext) -> None:
        """Registers the clean-up and applies the per-peer limits (aborting the call past
        them)."""
        if not context.add_callback(self.end):  # the client has gone already
            self.end()
            context.abort(grpc.StatusCode.CANCELLED, "the call ended before it started")
        if self.tokenless:
            peer = peer_address(context.peer())
            refused = self.admission.enter_peer(peer, self.open_method)
            if refused:
                _refused(self.method, "peer_limit")
                context.set_trailing_metadata(((RETRY_AFTER_METADATA, str(RETRY_AFTER_MS)),))
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refused)
            self.peer = peer
        if self.streaming and self.caller is not None and not self.tokenless:
            self.stream = _OpenStream(self.method, self.caller, context)
            self.admission.track_stream(self.stream)

    def end(self) -> None:
        self.admission.leave(self)

    def first_message(
        self, requests: Iterator[bytes], context: grpc.ServicerContext
    ) -> bytes | None:
        """The first request message, within the message deadline; None when the client
        closed without one. A call ended meanwhile (by the deadline or the client) raises
        grpc's RpcError, which grpc takes quietly."""
        pending = _Pending(context, self.method, self.admission.message_seconds(self.open_method))
        self.admission.expect_message(pending)
        try:
            return next(requests, None)
        finally:
            pending.context = None


class _Behavior:
    """What grpc calls for an admitted call: always ``(request_iterator, context)``."""

    def __init__(
        self,
        call: _AdmittedCall,
        inner: Callable[..., Any],
        deserialize: Callable[[bytes], Any] | None,
        request_streaming: bool,
    ) -> None:
        self._call = call
        self._inner = inner
        self._deserialize = deserialize
        self._request_streaming = request_streaming

    def __call__(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> Any:
        call = self._call
        call.start(context)
        first = call.first_message(requests, context)
        if not self._request_streaming:
            if first is None:
                message = f"{call.method} takes one request message; the call closed without it"
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
                raise AssertionError(message)  # abort raised already
            try:
                request = self._parse(first)
            except InvalidArgument as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, exc.message)
            return self._inner(request, context)
        return self._inner(self._stream(first, requests), context)

    def _stream(self, first: bytes | None, requests: Iterator[bytes]) -> Iterator[Any]:
        if first is None:
            return
        yield self._parse(first)
        for raw in requests:
            yield self._parse(raw)

    def _parse(self, raw: bytes) -> Any:
        if self._deserialize is None:
            return raw
        try:
            return self._deserialize(raw)
        except (DecodeError, ValueError, RecursionError) as exc:
            _refused(self._call.method, "malformed")
            raise InvalidArgument(
                f"a request message of {self._call.method} is not valid protobuf: {exc}"
            ) from None


class _AdmissionInterceptor(grpc.ServerInterceptor):  # type: ignore[misc]
    def __init__(self, admission: Admission) -> None:
        self._admission = admission

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        handler = continuation(details)
        if handler is None:
            return None
        try:
            return self._admission.admit(
                handler, details.method, tuple(details.invocation_metadata or ())
            )
        except Exception:
            # Raised from here, grpc would answer UNKNOWN "Error in service handler!".
            message = internal_error_message("admission_failed", method=details.method)
            return self._admission.refusal(details.method, grpc.StatusCode.INTERNAL, message)


__all__ = [
    "HEALTH_CALLS_PER_PEER",
    "HEALTH_MESSAGE_SECONDS",
    "HEALTH_WORKERS",
    "OPEN_PREFIXES",
    "Admission",
    "CallAuthorizer",
    "CallLimits",
    "Caller",
    "Lane",
    "end_call",
    "peer_address",
]
