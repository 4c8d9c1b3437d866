"""A direct channel to an executor's engine, for a client on the executor's host: Forward
without a gRPC call each.

``ExecutorClient.open_channel()`` asks the executor for a ticket over gRPC once (auth and scope
as every call), connects to the engine's local socket and presents it; from then on each
``forward`` writes the input into a registered ring (CUDA or shared memory), sends the engine a
small descriptor (``moelora.client.engine_wire``) and reads its answer from the same socket —
no protobuf, no HTTP/2, no front-end process in between. One request is in flight per channel
at a time (a channel is a pipe, not a pool: open one per thread; the asyncio channel,
``moelora.client.channel_aio``, multiplexes); the engine answers RESOURCE_EXHAUSTED past its
per-channel limit.

A client in another language speaks the same frames (docs/api.md): HELLO {"ticket", "pid"} as
JSON, then FORWARD descriptors, reading RESULT and STATE frames.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import socket
import threading
from typing import Any

from moelora.client.engine_wire import (
    Connection,
    ForwardDescriptor,
    ForwardResult,
    Kind,
    TensorRef,
    raise_for,
)
from moelora.client.errors import DeadlineExceeded, FailedPrecondition, Unavailable
from moelora.client.shared_memory import Array, ForwardRing, Slot
from moelora.client.tensors import WIRE_TYPES
from moelora.v1 import executor_pb2

#: (num_tokens, adapter reference or None for the base model), in token order.
Segments = list[tuple[int, str | None]]


class ForwardChannel:
    """A connected, admitted channel (``ExecutorClient.open_channel``). ``timeout``: how long
    one call may take before DeadlineExceeded; ``slot_wait``: how long the engine may hold a
    request for GPU slots (capped by the executor's own limit)."""

    def __init__(
        self,
        opened: executor_pb2.OpenChannelResponse,
        timeout: float = 30.0,
        slot_wait: float = 10.0,
    ) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(opened.socket_path)
        except OSError as exc:
            sock.close()
            raise FailedPrecondition(
                f"channel: cannot reach the engine's socket {opened.socket_path} ({exc}); a "
                "client in another container needs the executor's --channel-dir shared with it",
                "channel",
            ) from None
        sock.settimeout(timeout)
        self._connection = Connection(sock)
        self._connection.send_json(Kind.HELLO, {"ticket": opened.ticket, "pid": os.getpid()})
        self.max_in_flight = opened.max_in_flight
        #: The versions leased for the channel's life ("name:VERSION", as asked); a request
        #: on the channel may name the i-th as "#i" (resolved once, at the lease).
        self.leased = list(opened.leased)
        self.slot_wait = slot_wait
        self.serving = True
        self.reason = ""
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def forward(
        self,
        layer: int,
        hidden: Array,
        ring: ForwardRing,
        segments: Segments | None = None,
    ) -> tuple[Array, ForwardResult]:
        """One MoE layer for ``hidden`` (T, H) through a slot of ``ring`` (which must hold
        it): the output (a copy, as ``ring.output`` makes it) and the engine's result (its
        resolved adapters, adapters loaded, server time). Errors raise as for Forward."""
        slot = take_slot(ring, hidden)
        try:
            descriptor = ring_descriptor(
                ring, slot, hidden, layer, segments, next(self._ids), self.slot_wait
            )
            result = self.send(descriptor)
            raise_for(result.code, result.message, result.retry_after_ms)
            return ring.output(slot, hidden), result
        finally:
            ring.give_back(slot)

    def send(self, descriptor: ForwardDescriptor) -> ForwardResult:
        """Sends one descriptor and waits for its result (any status)."""
        with self._lock:
            try:
                self._connection.send(Kind.FORWARD, descriptor.encode())
                while True:
                    kind, payload = self._connection.recv()
                    if kind is Kind.RESULT:
                        result = ForwardResult.decode(payload)
                        if result.request_id == descriptor.request_id:
                            return result
                        continue  # a late answer to a call that timed out
                    if kind is Kind.STATE:
                        state: dict[str, Any] = json.loads(payload)
                        self.serving, self.reason = bool(state["serving"]), str(state["reason"])
            except TimeoutError:
                raise DeadlineExceeded("channel: no answer within the channel's timeout") from None
            except (EOFError, OSError):
                self._last_words()
                raise Unavailable(
                    f"channel: the engine closed it ({self.reason or 'it stopped'}); open another"
                ) from None

    def _last_words(self) -> None:
        last = last_words(self._connection)
        if last is not None:
            self.serving, self.reason = last

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._connection.close()

    def __enter__(self) -> ForwardChannel:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


def last_words(connection: Connection) -> tuple[bool, str] | None:
    """What the engine said last before it hung up (a send can fail before the frames
    already here are read): whether it serves, and its reason; None if it said nothing."""
    last = None
    with contextlib.suppress(EOFError, OSError, ValueError):
        connection.sock.settimeout(0.5)
        while True:
            kind, payload = connection.recv()
            if kind is Kind.STATE:
                state: dict[str, Any] = json.loads(payload)
                last = bool(state["serving"]), str(state["reason"])
    return last


def take_slot(ring: ForwardRing, hidden: Any) -> Slot:
    """A free slot of ``ring`` for ``hidden``; ValueError if none (a channel carries no bytes)."""
    slot = ring.take(hidden)
    if slot is None:
        raise ValueError(
            "hidden does not fit a free slot of the ring (its dtype, T or every slot busy); "
            "a channel carries no bytes"
        )
    return slot


def ring_descriptor(
    ring: ForwardRing,
    slot: Slot,
    hidden: Any,
    layer: int,
    segments: Segments | None,
    request_id: int,
    slot_wait: float,
) -> ForwardDescriptor:
    """Writes ``hidden`` into ``slot`` of ``ring`` and describes the request naming it."""
    wire = [executor_pb2.Segment(num_tokens=n, adapter=a or "") for n, a in segments or ()]
    request = ring.request(slot, hidden, layer, wire)
    return ForwardDescriptor(
        request_id=request_id,
        layer=layer,
        slot_wait=slot_wait,
        decode_seconds=0.0,
        scope="",  # the engine takes the ticket's
        hidden=tensor_ref(request.shared_hidden_states),
        output=tensor_ref(request.shared_output),
        segments=tuple((s.num_tokens, s.adapter) for s in request.segments),
    )


def tensor_ref(tensor: executor_pb2.SharedTensor) -> TensorRef:
    """The engine's reference for a tensor a Forward request names in a region."""
    shape = tuple(int(d) for d in tensor.shape)
    nbytes = math.prod(shape) * WIRE_TYPES[tensor.dtype].itemsize
    return TensorRef(tensor.region, tensor.offset, nbytes, tensor.dtype, shape)
