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

A channel opened with ``spin=True`` asks for a spin block (``moelora.client.spin_block``):
its descriptors and answers then go through memory shared with the engine, which the launch
loop polls and the client polls back — no system call and no thread wake-up per call, for a
client that calls once per layer and can spare a core while it waits.

A client in another language speaks the same frames (docs/api.md): HELLO {"ticket", "pid"} as
JSON, then FORWARD descriptors, reading RESULT and STATE frames.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import select
import socket
import threading
import time
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
from moelora.client.shared_memory import Array, ForwardRing, Slot, settle
from moelora.client.spin_block import SpinBlock
from moelora.client.tensors import WIRE_TYPES
from moelora.v1 import executor_pb2

#: (num_tokens, adapter reference or None for the base model), in token order.
Segments = list[tuple[int, str | None]]

#: How long a spin channel's caller polls for its answer without pause, and then how long it
#: sleeps between looks (a long wait: adapters loading) and between looks at the socket.
SPIN_SECONDS = 0.005
NAP_SECONDS = 0.0001
SOCKET_CHECK_SECONDS = 0.005


class ForwardChannel:
    """A connected, admitted channel (``ExecutorClient.open_channel``). ``timeout``: how long
    one call may take before DeadlineExceeded; ``slot_wait``: how long the engine may hold a
    request for GPU slots (capped by the executor's own limit)."""

    def __init__(
        self,
        opened: executor_pb2.OpenChannelResponse,
        timeout: float = 30.0,
        slot_wait: float = 10.0,
        spin: bool = False,
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
        self.timeout = timeout
        hello: dict[str, Any] = {"ticket": opened.ticket, "pid": os.getpid()}
        if spin:
            hello["spin"] = True
        self._connection.send_json(Kind.HELLO, hello)
        self.serving = True
        self.reason = ""
        #: The spin block, where the engine gave one (``spin``; else the socket carries all).
        self.block = self._admitted() if spin else None
        self.max_in_flight = 1 if self.block is not None else opened.max_in_flight
        #: The versions leased for the channel's life ("name:VERSION", as asked); a request
        #: on the channel may name the i-th as "#i" (resolved once, at the lease).
        self.leased = list(opened.leased)
        self.slot_wait = slot_wait
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def _admitted(self) -> SpinBlock | None:
        """Reads the engine's frames up to its admission and maps the block sent with it."""
        try:
            while True:
                kind, payload, fd = self._connection.recv_fd()
                admitted = kind is Kind.STATE and self._take_state(payload).get("admitted")
                if admitted:
                    return None if fd is None else SpinBlock(fd)
                if fd is not None:  # a block that came with any other frame is not taken
                    os.close(fd)
                if kind is not Kind.STATE:
                    raise ValueError(f"unexpected frame {kind.name} before admission")
        except TimeoutError:
            self.close()
            raise DeadlineExceeded("channel: the engine did not admit it in time") from None
        except (EOFError, OSError, ValueError):
            self.close()
            raise Unavailable(f"channel: the engine refused it ({self.reason})") from None

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
        failure: BaseException | None = None
        try:
            descriptor = ring_descriptor(
                ring, slot, hidden, layer, segments, next(self._ids), self.slot_wait
            )
            result = self.send(descriptor)
            raise_for(result.code, result.message, result.retry_after_ms)
            return ring.output(slot, hidden), result
        except BaseException as exc:
            failure = exc
            raise
        finally:
            settle(ring, slot, failure)

    def send(self, descriptor: ForwardDescriptor) -> ForwardResult:
        """Sends one descriptor and waits for its result (any status)."""
        if self.block is not None:
            return self._spin(self.block, descriptor)
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
                        self._take_state(payload)
            except TimeoutError:
                raise DeadlineExceeded("channel: no answer within the channel's timeout") from None
            except (EOFError, OSError):
                self._last_words()
                raise Unavailable(
                    f"channel: the engine closed it ({self.reason or 'it stopped'}); open another"
                ) from None

    def _spin(self, block: SpinBlock, descriptor: ForwardDescriptor) -> ForwardResult:
        """One request through the spin block: posted, the engine woken if it sleeps, the
        answer polled for (ValueError: a descriptor too large for the block)."""
        request_id = descriptor.request_id
        with self._lock:
            block.post(request_id, descriptor.encode())
            try:
                if not block.engine_polling:
                    self._connection.send(Kind.BELL, b"")
                start = time.perf_counter()
                look = start + SOCKET_CHECK_SECONDS
                while True:
                    answer = block.answer(request_id)
                    if answer is not None:
                        return ForwardResult.decode(answer)
                    now = time.perf_counter()
                    if now - start < SPIN_SECONDS:
                        time.sleep(0)
                        continue
                    if now >= look:
                        self._look_at_socket()
                        look = now + SOCKET_CHECK_SECONDS
                    if now - start > self.timeout:
                        self.close()  # its answer may yet come: the block is no longer ours
                        raise DeadlineExceeded("channel: no answer within the channel's timeout")
                    time.sleep(NAP_SECONDS)
            except (EOFError, OSError):
                self._last_words()
                self.close()
                raise Unavailable(
                    f"channel: the engine closed it ({self.reason or 'it stopped'}); open another"
                ) from None

    def _look_at_socket(self) -> None:
        """Takes the engine's STATE frames; EOFError once it hung up."""
        readable = select.poll()  # not select(): descriptors past 1,024 are common in servers
        readable.register(self._connection.sock, select.POLLIN)
        while readable.poll(0):
            kind, payload = self._connection.recv()
            if kind is Kind.STATE:
                self._take_state(payload)

    def _take_state(self, payload: bytes) -> dict[str, Any]:
        """A STATE frame: whether the engine serves (and why not); its fields."""
        state: dict[str, Any] = json.loads(payload)
        self.serving, self.reason = bool(state["serving"]), str(state["reason"])
        return state

    def _last_words(self) -> None:
        last = last_words(self._connection)
        if last is not None:
            self.serving, self.reason = last

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._connection.close()
        block, self.block = self.block, None
        if block is not None:
            block.close()

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
