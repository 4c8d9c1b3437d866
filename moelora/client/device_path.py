"""The path an ``ExecutorClient`` takes, unasked, for CUDA tensors: the fastest the pair can
use.

- Where the executor can read this process's CUDA memory in place (the same host and a GPU it
  reaches): a ring in CUDA memory registered once (``cuda_ring``) and a direct channel per
  calling thread (``channel``) with a spin block where the executor gives one, so a call
  moves no tensor bytes through the host, makes no gRPC call and, while the calls come
  often, no system call either.
- Where it cannot (another host, or a GPU it cannot map): a network channel per calling thread
  (``network_channel``), the tensors GPU to GPU over NCCL, if the executor takes them.
- Else, and for calls neither can hold (more tokens than a ring slot, every slot busy, routing
  given): the tensors' bytes in the message, as before.

Set up on the first CUDA-tensor call; each refusal (an executor on the CPU, a handle it cannot
map, a channel socket this container cannot reach, no network channels) is said once in the
client's log with the transport chosen instead (``executor_transport``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import TYPE_CHECKING

from moelora.client.channel import ForwardChannel
from moelora.client.cuda_ipc import CudaError
from moelora.client.cuda_ring import CudaMemoryRing
from moelora.client.errors import DeadlineExceeded, MoeLoraError, Unavailable
from moelora.client.logs import log_event
from moelora.client.network_channel import NetworkChannel

if TYPE_CHECKING:
    import torch

    from moelora.client.engine_wire import ForwardResult as ChannelResult
    from moelora.client.executor import ExecutorClient, ForwardResult, Segments

log = logging.getLogger(__name__)

#: The transports a client reports (``DevicePath.transport``).
MESSAGE, CUDA_MEMORY, CUDA_CHANNEL = "message", "cuda_memory", "cuda_memory+channel"
NETWORK_CHANNEL = "network_channel"


class DevicePath:
    """The CUDA ring and channels of one client (see the module doc). ``max_tokens``: the
    largest T a slot holds; ``slots``: calls in flight at once through the ring; ``spin``:
    direct channels ask for spin blocks."""

    def __init__(
        self, client: ExecutorClient, max_tokens: int, slots: int, spin: bool = True
    ) -> None:
        self._client = client
        self._spin = spin
        self._max_tokens = max_tokens
        self._slots = slots
        self._lock = threading.Lock()
        self._rings: dict[tuple[str, str], CudaMemoryRing] = {}
        self._local = threading.local()
        self._channels: list[ForwardChannel | NetworkChannel] = []
        #: What calls with CUDA tensors use now (``MESSAGE`` until the first such call).
        self.transport = MESSAGE
        self._refused = False
        self._channel_refused = False
        self._network_refused = False

    def forward(
        self, layer: int, hidden: torch.Tensor, segments: Segments | None, timeout: float | None
    ) -> ForwardResult[torch.Tensor] | None:
        """The answer through the ring (and this thread's channel), or over this thread's
        network channel where the executor cannot map the ring, or None: send bytes."""
        ring = None
        if not self._refused and 1 <= int(hidden.shape[0]) <= self._max_tokens:
            ring = self._ring(hidden)
        if ring is None:
            return self._over_network(layer, hidden, segments, timeout) if self._refused else None
        channel = self._channel(timeout)
        if channel is None:
            return self._client.forward(layer, hidden, segments, timeout=timeout, ring=ring)
        try:
            output, result = channel.forward(layer, hidden, ring, list(segments or ()))
        except ValueError:  # every slot busy
            return None
        except Unavailable:  # the engine closed it (draining, restarted): bytes, with retries
            self._local.channel = None
            return None
        return channel_answer(output, result)

    def _over_network(
        self, layer: int, hidden: torch.Tensor, segments: Segments | None, timeout: float | None
    ) -> ForwardResult[torch.Tensor] | None:
        channel = self._network_channel(hidden, timeout)
        if channel is None:
            return None
        try:
            output, result = channel.forward(layer, hidden, list(segments or ()))
        except ValueError:  # a tensor the channel does not carry (another device, a dtype)
            return None
        except (Unavailable, DeadlineExceeded):  # the channel ended: bytes, with retries
            self._local.network = None
            return None
        return channel_answer(output, result)

    def _network_channel(
        self, hidden: torch.Tensor, timeout: float | None
    ) -> NetworkChannel | None:
        channel: NetworkChannel | None = getattr(self._local, "network", None)
        if channel is not None or self._network_refused:
            return channel
        try:
            channel = self._client.open_network_channel(hidden.device, timeout)
        except MoeLoraError as exc:
            with self._lock:
                self._network_refused = True
                self._choose(MESSAGE, f"network channel refused: {exc}")
            return None
        with self._lock:
            self._channels.append(channel)
            if self.transport != NETWORK_CHANNEL:
                self._choose(NETWORK_CHANNEL, "the executor cannot map this process's memory")
        self._local.network = channel
        return channel

    def _ring(self, hidden: torch.Tensor) -> CudaMemoryRing | None:
        dtype = str(hidden.dtype).removeprefix("torch.")
        key = (str(hidden.device), dtype)
        with self._lock:
            if self._refused:
                return None
            ring = self._rings.get(key)
            if ring is not None:
                return ring
            try:
                ring = self._client.register_cuda_ring(
                    int(hidden.shape[1]), self._max_tokens, hidden.device, self._slots, dtype
                )
            except (MoeLoraError, CudaError, ValueError) as exc:
                self._refused = True
                self._choose(MESSAGE, f"CUDA memory refused: {exc}")
                return None
            self._rings[key] = ring
            if self.transport == MESSAGE:
                self._choose(CUDA_CHANNEL, "the executor maps this process's CUDA memory")
            return ring

    def _channel(self, timeout: float | None) -> ForwardChannel | None:
        channel: ForwardChannel | None = getattr(self._local, "channel", None)
        if channel is not None or self._channel_refused:
            return channel
        try:
            channel = self._client.open_channel(timeout, spin=self._spin)
        except MoeLoraError as exc:
            with self._lock:
                self._channel_refused = True
                self._choose(CUDA_MEMORY, f"direct channel refused: {exc}")
            return None
        with self._lock:
            self._channels.append(channel)
        self._local.channel = channel
        return channel

    def _choose(self, transport: str, reason: str) -> None:
        self.transport = transport
        log_transport(self._client.address, transport, reason)

    def close(self) -> None:
        """Closes the channels, unregisters and frees the rings."""
        with self._lock:
            channels, self._channels = self._channels, []
            rings, self._rings = list(self._rings.values()), {}
        for channel in channels:
            channel.close()
        for ring in rings:
            with contextlib.suppress(MoeLoraError):
                self._client.unregister_cuda_ring(ring)
            ring.close()


def channel_answer(output: torch.Tensor, result: ChannelResult) -> ForwardResult[torch.Tensor]:
    """A channel's answer as ``ExecutorClient.forward`` gives it."""
    from moelora.client.executor import ForwardResult

    return ForwardResult(
        output=output,
        resolved_adapters=list(result.resolved_adapters),
        server_time_us=result.server_time_us,
        adapters_resident=result.adapters_loaded == 0,
        adapters_loaded=result.adapters_loaded,
    )


def log_transport(address: str, transport: str, reason: str) -> None:
    """Says once which way a client's CUDA tensors now travel, and why."""
    log_event(log, "executor_transport", address=address, transport=transport, reason=reason)
