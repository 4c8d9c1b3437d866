"""A direct channel to an executor's engine for asyncio backends
(``AsyncExecutorClient.open_channel``): ``moelora.client.channel``'s frames, with many requests
in flight on one channel (up to its ``max_in_flight``), each answered by request id.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
from typing import Any

from moelora.client.channel import Segments, ring_descriptor, take_slot
from moelora.client.engine_wire import (
    FRAME_HEAD,
    ForwardDescriptor,
    ForwardResult,
    Kind,
    frame,
    raise_for,
)
from moelora.client.errors import DeadlineExceeded, FailedPrecondition, Unavailable
from moelora.client.shared_memory import Array, ForwardRing, settle
from moelora.v1 import executor_pb2


class AsyncForwardChannel:
    """A connected channel (``AsyncExecutorClient.open_channel``); ``timeout`` bounds each
    call, ``slot_wait`` how long the engine may hold a request for GPU slots."""

    def __init__(
        self,
        opened: executor_pb2.OpenChannelResponse,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        timeout: float,
        slot_wait: float,
    ) -> None:
        self.max_in_flight = opened.max_in_flight
        #: The versions leased for the channel's life ("name:VERSION", as asked); a request
        #: on the channel may name the i-th as "#i" (resolved once, at the lease).
        self.leased = list(opened.leased)
        self.timeout = timeout
        self.slot_wait = slot_wait
        self.serving = True
        self.reason = ""
        self._reader = reader
        self._writer = writer
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[ForwardResult]] = {}
        self._closed: str | None = None
        self._reading = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def connect(
        cls, opened: executor_pb2.OpenChannelResponse, timeout: float, slot_wait: float
    ) -> AsyncForwardChannel:
        try:
            reader, writer = await asyncio.open_unix_connection(opened.socket_path)
        except OSError as exc:
            raise FailedPrecondition(
                f"channel: cannot reach the engine's socket {opened.socket_path} ({exc}); a "
                "client in another container needs the executor's --channel-dir shared with it",
                "channel",
            ) from None
        hello = json.dumps({"ticket": opened.ticket, "pid": os.getpid()}).encode()
        writer.write(frame(Kind.HELLO, hello))
        return cls(opened, reader, writer, timeout, slot_wait)

    async def forward(
        self, layer: int, hidden: Array, ring: ForwardRing, segments: Segments | None = None
    ) -> tuple[Array, ForwardResult]:
        """As ``ForwardChannel.forward``; calls may overlap."""
        slot = take_slot(ring, hidden)
        failure: BaseException | None = None
        try:
            descriptor = ring_descriptor(
                ring, slot, hidden, layer, segments, next(self._ids), self.slot_wait
            )
            result = await self.send(descriptor)
            raise_for(result.code, result.message, result.retry_after_ms)
            return ring.output(slot, hidden), result
        except BaseException as exc:
            failure = exc
            raise
        finally:
            settle(ring, slot, failure)

    async def send(self, descriptor: ForwardDescriptor) -> ForwardResult:
        """Sends one descriptor and waits for its result (any status)."""
        if self._closed is not None:
            raise Unavailable(self._closed)
        answer: asyncio.Future[ForwardResult] = asyncio.get_running_loop().create_future()
        self._waiting[descriptor.request_id] = answer
        try:
            self._writer.write(frame(Kind.FORWARD, descriptor.encode()))
            await self._writer.drain()
            return await asyncio.wait_for(answer, self.timeout)
        except TimeoutError:
            raise DeadlineExceeded("channel: no answer within the channel's timeout") from None
        except OSError:
            # The engine hung up: let the reader take in its last words (the reason).
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(self._reading), 0.5)
            raise Unavailable(self._closed or "channel: the engine closed it") from None
        finally:
            self._waiting.pop(descriptor.request_id, None)

    async def _read(self) -> None:
        try:
            while True:
                length, kind = FRAME_HEAD.unpack(await self._reader.readexactly(FRAME_HEAD.size))
                payload = await self._reader.readexactly(length)
                if kind == Kind.RESULT:
                    result = ForwardResult.decode(payload)
                    waiter = self._waiting.get(result.request_id)
                    if waiter is not None and not waiter.done():
                        waiter.set_result(result)
                elif kind == Kind.STATE:
                    state: dict[str, Any] = json.loads(payload)
                    self.serving, self.reason = bool(state["serving"]), str(state["reason"])
        except (asyncio.IncompleteReadError, OSError):
            pass
        self._closed = (
            f"channel: the engine closed it ({self.reason or 'it stopped'}); open another"
        )
        for waiter in self._waiting.values():
            if not waiter.done():
                waiter.set_exception(Unavailable(self._closed))

    async def close(self) -> None:
        self._reading.cancel()
        self._writer.close()
        with contextlib.suppress(OSError, asyncio.CancelledError):
            await self._writer.wait_closed()
            await self._reading

    async def __aenter__(self) -> AsyncForwardChannel:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.close()
