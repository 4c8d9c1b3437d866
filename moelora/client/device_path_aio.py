"""The path an ``AsyncExecutorClient`` takes, unasked, for CUDA tensors (as
``moelora.client.device_path`` for the blocking client):

- a CUDA ring registered once and one asyncio direct channel that carries every coroutine's
  calls at once (up to the channel's in-flight limit and the ring's slots), where the
  executor can map the ring; where only the channel is refused, the ring over gRPC;
- where it cannot (another host or GPU, a CPU executor, the same process), network channels
  (``network_channel_aio``), one per call in flight, kept in a pool of up to ``slots``, if
  the executor takes them;
- else, and for calls neither can hold (more tokens than a slot, every slot busy, routing
  given), the tensors' bytes.

Each choice is logged once (``executor_transport``); ``transport`` says which.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING

from moelora.client.cuda_ipc import CudaError
from moelora.client.cuda_ring import CudaMemoryRing
from moelora.client.device_path import (
    CUDA_CHANNEL,
    CUDA_MEMORY,
    MESSAGE,
    NETWORK_CHANNEL,
    channel_answer,
    log_transport,
)
from moelora.client.errors import DeadlineExceeded, MoeLoraError, Unavailable

if TYPE_CHECKING:
    import torch

    from moelora.client.channel_aio import AsyncForwardChannel
    from moelora.client.executor import ForwardResult, Segments
    from moelora.client.executor_aio import AsyncExecutorClient
    from moelora.client.network_channel_aio import AsyncNetworkChannel


class AsyncDevicePath:
    """The CUDA ring and the channel of one asyncio client. ``max_tokens``: the largest T a
    slot holds; ``slots``: calls in flight at once through the ring."""

    def __init__(self, client: AsyncExecutorClient, max_tokens: int, slots: int) -> None:
        self._client = client
        self._max_tokens = max_tokens
        self._slots = slots
        self._lock = asyncio.Lock()
        self._ring: CudaMemoryRing | None = None
        self._channel: AsyncForwardChannel | None = None
        #: What calls with CUDA tensors use now (``MESSAGE`` until the first such call).
        self.transport = MESSAGE
        self._refused = False
        self._channel_refused = False
        self._network_refused = False
        #: Network channels not in use now, and how many are open (at most ``slots``).
        self._idle: list[AsyncNetworkChannel] = []
        self._network_open = 0
        self._network_freed = asyncio.Condition()

    async def forward(
        self, layer: int, hidden: torch.Tensor, segments: Segments | None, timeout: float | None
    ) -> ForwardResult[torch.Tensor] | None:
        """The answer through the ring (over the channel, or gRPC), or over a network channel
        where the executor cannot map the ring, or None: send bytes."""
        ring = None
        if not self._refused and 1 <= int(hidden.shape[0]) <= self._max_tokens:
            ring = await self._ring_for(hidden)
        if ring is None:
            return (
                await self._over_network(layer, hidden, segments, timeout)
                if self._refused
                else None
            )
        channel = await self._open_channel(timeout)
        if channel is None:
            return await self._client.forward(layer, hidden, segments, timeout=timeout, ring=ring)
        try:
            output, result = await channel.forward(layer, hidden, ring, list(segments or ()))
        except ValueError:  # every slot busy, or another device's or dtype's tensor
            return None
        except (Unavailable, DeadlineExceeded):  # the channel ended: bytes, with retries
            await self._drop(channel)
            return None
        return channel_answer(output, result)

    async def _over_network(
        self, layer: int, hidden: torch.Tensor, segments: Segments | None, timeout: float | None
    ) -> ForwardResult[torch.Tensor] | None:
        channel = await self._take_network(hidden, timeout)
        if channel is None:
            return None
        try:
            output, result = await channel.forward(layer, hidden, list(segments or ()))
        except ValueError:  # a tensor the channel does not carry (another device, a dtype)
            await self._give_network(channel)
            return None
        except (Unavailable, DeadlineExceeded):  # the channel ended: bytes, with retries
            await self._give_network(channel, ended=True)
            return None
        except BaseException:  # the engine's answer for this request: the channel serves on
            await self._give_network(channel)
            raise
        await self._give_network(channel)
        return channel_answer(output, result)

    async def _take_network(
        self, hidden: torch.Tensor, timeout: float | None
    ) -> AsyncNetworkChannel | None:
        """An idle network channel, a new one while fewer than ``slots`` are open, or the
        next one given back; None where the executor takes none."""
        async with self._network_freed:
            while not self._idle and self._network_open >= self._slots:
                if self._network_refused:
                    return None
                await self._network_freed.wait()
            if self._idle:
                return self._idle.pop()
            if self._network_refused:
                return None
            self._network_open += 1
        try:
            channel = await self._client.open_network_channel(hidden.device, timeout)
        except MoeLoraError as exc:
            async with self._network_freed:
                self._network_open -= 1
                if not self._network_refused:
                    self._network_refused = True
                    self._choose(MESSAGE, f"network channel refused: {exc}")
                self._network_freed.notify_all()
            return None
        if self.transport != NETWORK_CHANNEL:
            self._choose(NETWORK_CHANNEL, "the executor cannot map this process's memory")
        return channel

    async def _give_network(self, channel: AsyncNetworkChannel, ended: bool = False) -> None:
        async with self._network_freed:
            if ended:
                self._network_open -= 1
            else:
                self._idle.append(channel)
            self._network_freed.notify()
        if ended:
            await channel.close()

    async def _ring_for(self, hidden: torch.Tensor) -> CudaMemoryRing | None:
        ring = self._ring
        if ring is not None:  # one ring: the first call's device and dtype
            return ring if (ring.device, ring.dtype) == (hidden.device, hidden.dtype) else None
        async with self._lock:
            if self._refused:
                return None
            if self._ring is None:
                dtype = str(hidden.dtype).removeprefix("torch.")
                try:
                    self._ring = await self._client.register_cuda_ring(
                        int(hidden.shape[1]), self._max_tokens, hidden.device, self._slots, dtype
                    )
                except (MoeLoraError, CudaError, ValueError) as exc:
                    self._refused = True
                    self._choose(MESSAGE, f"CUDA memory refused: {exc}")
                    return None
                self._choose(CUDA_CHANNEL, "the executor maps this process's CUDA memory")
        return await self._ring_for(hidden)

    async def _open_channel(self, timeout: float | None) -> AsyncForwardChannel | None:
        if self._channel is not None or self._channel_refused:
            return self._channel
        async with self._lock:
            if self._channel is None and not self._channel_refused:
                try:
                    self._channel = await self._client.open_channel(timeout)
                except MoeLoraError as exc:
                    self._channel_refused = True
                    self._choose(CUDA_MEMORY, f"direct channel refused: {exc}")
            return self._channel

    async def _drop(self, channel: AsyncForwardChannel) -> None:
        """Forgets a channel that ended (the next call opens another)."""
        async with self._lock:
            if self._channel is channel:
                self._channel = None
        with contextlib.suppress(OSError):
            await channel.close()

    def _choose(self, transport: str, reason: str) -> None:
        self.transport = transport
        log_transport(self._client.address, transport, reason)

    async def close(self) -> None:
        """Closes the channels, unregisters and frees the ring."""
        channel, self._channel = self._channel, None
        ring, self._ring = self._ring, None
        idle, self._idle = self._idle, []
        if channel is not None:
            await channel.close()
        for network in idle:
            await network.close()
        if ring is not None:
            with contextlib.suppress(MoeLoraError):
                await self._client.unregister_cuda_ring(ring)
            ring.close()
