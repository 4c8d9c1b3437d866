"""A network channel for asyncio backends (``AsyncExecutorClient.open_network_channel``):
``moelora.client.network_channel``'s frames over an asyncio TCP stream and its group's
transfers, one request at a time per channel (open several for calls that overlap; the
asyncio device path keeps a pool). The group's blocking steps (its rendezvous, Gloo's waits)
run on a worker thread, so the event loop never waits for a tensor.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
from typing import TYPE_CHECKING, Any

from moelora.client.engine_wire import FRAME_HEAD, ForwardResult, Kind, frame, raise_for
from moelora.client.errors import DeadlineExceeded, FailedPrecondition, Unavailable
from moelora.client.network_channel import (
    Segments,
    Transfers,
    check_backend,
    network_descriptor,
)
from moelora.v1 import executor_pb2

if TYPE_CHECKING:
    import torch


class AsyncNetworkChannel:
    """A connected network channel whose tensors are on ``device`` (``connect``);
    ``timeout`` bounds each call, ``slot_wait`` how long the engine may hold a request for
    GPU slots."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        transfers: Transfers,
        opened: executor_pb2.OpenChannelResponse,
        device: torch.device,
        timeout: float,
        slot_wait: float,
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._transfers: Transfers | None = transfers
        self.device = device
        self.leased = list(opened.leased)
        self.timeout = timeout
        self.slot_wait = slot_wait
        self.serving = True
        self.reason = ""
        self._ids = itertools.count(1)
        self._lock = asyncio.Lock()

    @classmethod
    async def connect(
        cls,
        opened: executor_pb2.OpenChannelResponse,
        device: torch.device,
        timeout: float,
        slot_wait: float,
    ) -> AsyncNetworkChannel:
        check_backend(opened, device)
        host, _, port = opened.network_address.rpartition(":")
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host.strip("[]"), int(port)), timeout
            )
        except (OSError, TimeoutError) as exc:
            raise FailedPrecondition(
                f"channel: cannot reach the engine at {opened.network_address} ({exc}); the "
                "executor's --network-channel-port must be reachable from this host",
                "channel",
            ) from None
        try:
            hello = json.dumps({"ticket": opened.ticket, "pid": os.getpid()}).encode()
            writer.write(frame(Kind.HELLO, hello))
            reason = await asyncio.wait_for(_admitted(reader), timeout)
            if reason is not None:
                raise Unavailable(f"channel: the engine turned it away ({reason})")
            transfers = await asyncio.to_thread(Transfers.join, opened, device)
        except BaseException as exc:
            writer.close()
            if isinstance(exc, TimeoutError):
                raise Unavailable("channel: the engine did not admit it in time") from None
            raise
        return cls(reader, writer, transfers, opened, device, timeout, slot_wait)

    async def forward(
        self, layer: int, hidden: torch.Tensor, segments: Segments | None = None
    ) -> tuple[torch.Tensor, ForwardResult]:
        """As ``NetworkChannel.forward``; a call waits for the one before it on this channel."""
        async with self._lock:
            transfers = self._transfers
            if transfers is None:
                raise Unavailable(f"channel: closed ({self.reason or 'by this client'})")
            descriptor, hidden = network_descriptor(
                self.device, layer, hidden, segments, next(self._ids), self.slot_wait
            )
            try:
                self._writer.write(frame(Kind.FORWARD, descriptor.encode()))
                output, receiving = transfers.post(hidden)
                result = await asyncio.wait_for(self._result(descriptor.request_id), self.timeout)
                if self.device.type == "cuda":
                    receiving.wait()  # the caller's current stream waits for the output
                else:
                    await asyncio.to_thread(receiving.wait)  # Gloo: until the bytes are in
            except TimeoutError:
                await self.close()
                raise DeadlineExceeded("channel: no answer within the channel's timeout") from None
            except (asyncio.IncompleteReadError, OSError, RuntimeError):
                await self.close()
                raise Unavailable(
                    f"channel: the engine closed it ({self.reason or 'it stopped'}); open another"
                ) from None
        raise_for(result.code, result.message, result.retry_after_ms)
        return output, result

    async def _result(self, request_id: int) -> ForwardResult:
        while True:
            kind, payload = await _frame(self._reader)
            if kind == Kind.RESULT:
                result = ForwardResult.decode(payload)
                if result.request_id == request_id:
                    return result
            elif kind == Kind.STATE:
                state: dict[str, Any] = json.loads(payload)
                self.serving, self.reason = bool(state["serving"]), str(state["reason"])

    async def close(self) -> None:
        """Closes the socket and ends the group (the engine frees the channel's buffer)."""
        transfers, self._transfers = self._transfers, None
        if transfers is not None:
            transfers.close()
        self._writer.close()
        with contextlib.suppress(OSError):
            await self._writer.wait_closed()

    async def __aenter__(self) -> AsyncNetworkChannel:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.close()


async def _frame(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    length, kind = FRAME_HEAD.unpack(await reader.readexactly(FRAME_HEAD.size))
    return kind, await reader.readexactly(length)


async def _admitted(reader: asyncio.StreamReader) -> str | None:
    """Reads the engine's states until it takes the ticket (None) or hangs up (its reason)."""
    reason = "it hung up"
    try:
        while True:
            kind, payload = await _frame(reader)
            if kind == Kind.STATE:
                state: dict[str, Any] = json.loads(payload)
                if state.get("admitted"):
                    return None
                reason = str(state["reason"]) or reason
    except (asyncio.IncompleteReadError, OSError):
        return reason
