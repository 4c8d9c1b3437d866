"""The stress client's same-host transports, through the client library as a user calls it
(``bench.stress_client --mode shm|device|channel|spin|network``).

* ``shm``: ``ExecutorClient.shared_memory`` — a registered ring, descriptors over gRPC;
* ``device``: CUDA tensors into a plain ``ExecutorClient``, which takes its own CUDA ring and
  direct channel (``moelora.client.device_path``); the run fails if it fell back to bytes;
* ``channel``: ``AsyncExecutorClient.open_channel`` with ``IN_FLIGHT`` calls at once over one
  channel and a ring (CUDA memory where this process has a GPU, shared memory otherwise); the
  channel is closed and reopened every ``CALLS_PER_CHANNEL`` calls, leasing an adapter the
  driver names (its segments then name it by the channel's handle, "#0"), so that tickets,
  leases and their release churn with the traffic;
* ``spin``: ``ExecutorClient.open_channel(spin=True)``, one call at a time through the
  channel's spin block and a ring (CUDA memory where this process has a GPU, shared memory
  otherwise), closed and reopened with a lease every ``CALLS_PER_CHANNEL`` calls;
* ``network``: ``ExecutorClient.open_network_channel`` from ``network_device`` (the CPU with
  Gloo for a CPU executor, another GPU with NCCL for a GPU executor), closed and reopened with
  a lease every ``CALLS_PER_CHANNEL`` calls as ``channel`` is.

Each call's answer goes to ``check`` as float32 rows (None when it failed).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import numpy as np
import torch

from executor_service.bench.stress_client import PoolRequest
from moelora.client.channel import ForwardChannel
from moelora.client.channel_aio import AsyncForwardChannel
from moelora.client.errors import MoeLoraError
from moelora.client.executor import ExecutorClient
from moelora.client.executor_aio import AsyncExecutorClient
from moelora.client.shared_memory import ForwardRing

#: (request, status code name, answer as float32 rows or None, seconds the call took).
Check = Callable[[PoolRequest, str, np.ndarray | None, float], None]
#: Calls one asyncio channel has in flight at once.
IN_FLIGHT = 4
#: Calls over one channel before it is closed (its lease released) and another opened.
CALLS_PER_CHANNEL = 64


def _hidden(item: PoolRequest, device: str) -> torch.Tensor:
    bits = torch.from_numpy(np.array(item.hidden, dtype=np.uint16).view(np.int16))
    return bits.view(torch.bfloat16).to(device)


def _segments(
    item: PoolRequest, handles: dict[str, str] | None = None
) -> list[tuple[int, str | None]]:
    """The request's segments; adapters in ``handles`` named by a channel's handle ("#0")."""
    handles = handles or {}
    return [(n, handles.get(adapter, adapter) or None) for n, adapter in item.segments]


def _answered(
    check: Check, item: PoolRequest, begin: float, output: torch.Tensor | MoeLoraError
) -> None:
    """Hands one call's outcome to ``check``: its status, and its answer as float32 rows."""
    took = time.perf_counter() - begin
    if isinstance(output, MoeLoraError):
        check(item, output.code.name, None, took)
    else:
        check(item, "OK", output.float().cpu().numpy(), took)


def run(
    address: str,
    pool: list[PoolRequest],
    mode: str,
    deadline: float,
    rng: random.Random,
    check: Check,
    lease: Sequence[str] = (),
    network_device: str = "cpu",
) -> list[str]:
    """Sends random pool requests until ``deadline``; returns problems that are no call's
    status (a transport that fell back, a channel that broke)."""
    # One thread for this process's torch conversions: a pool of threads a core each in every
    # client process spins on the cores that the executor's launch loop and front ends need.
    torch.set_num_threads(1)
    max_tokens = max(item.hidden.shape[0] for item in pool)
    hidden_size = pool[0].hidden.shape[1]
    if mode == "channel":
        ring_shape = (hidden_size, max_tokens)
        return asyncio.run(_channel(address, pool, deadline, rng, check, lease, ring_shape))
    if mode == "network":
        return _network(address, pool, deadline, rng, check, lease, torch.device(network_device))
    if mode == "spin":
        return _spin(address, pool, deadline, rng, check, lease, (hidden_size, max_tokens))
    gpu = mode == "device"
    with ExecutorClient(
        address, timeout=120, device_path=gpu, device_ring_tokens=max_tokens, device_ring_slots=1
    ) as client:
        if gpu:
            _calls(client, pool, deadline, rng, check, None, "cuda")
            if client.transport != "cuda_memory+channel":
                return [f"device path fell back: transport {client.transport}"]
            return []
        with client.shared_memory(hidden_size, max_tokens, slots=1) as ring:
            _calls(client, pool, deadline, rng, check, ring, "cpu")
    return []


def _calls(
    client: ExecutorClient,
    pool: list[PoolRequest],
    deadline: float,
    rng: random.Random,
    check: Check,
    ring: Any,
    device: str,
) -> None:
    while time.monotonic() < deadline:
        item = rng.choice(pool)
        hidden = _hidden(item, device)
        begin = time.perf_counter()
        output: torch.Tensor | MoeLoraError
        try:
            output = client.forward(item.layer, hidden, _segments(item), ring=ring).output
        except MoeLoraError as exc:
            output = exc
        _answered(check, item, begin, output)


#: Opens a channel leasing the adapters given (a context manager yielding it).
OpenChannel = Callable[[list[str]], AbstractContextManager[Any]]
#: One call over a channel: (channel, layer, hidden, segments) -> output.
ChannelCall = Callable[[Any, int, torch.Tensor, list[tuple[int, str | None]]], torch.Tensor]


def _reopened(
    open_channel: OpenChannel,
    call: ChannelCall,
    pool: list[PoolRequest],
    deadline: float,
    rng: random.Random,
    check: Check,
    lease: Sequence[str],
    device: str,
) -> list[str]:
    """Calls over a channel that is closed and reopened, leasing an adapter of ``lease``
    (named by its handle), every ``CALLS_PER_CHANNEL`` calls."""
    while time.monotonic() < deadline:
        leased = [rng.choice(lease)] if lease else []
        handles = {adapter: f"#{i}" for i, adapter in enumerate(leased)}
        with open_channel(leased) as channel:
            for _ in range(CALLS_PER_CHANNEL):
                if time.monotonic() >= deadline:
                    break
                item = rng.choice(pool)
                hidden = _hidden(item, device)
                begin = time.perf_counter()
                output: torch.Tensor | MoeLoraError
                try:
                    output = call(channel, item.layer, hidden, _segments(item, handles))
                except MoeLoraError as exc:
                    output = exc
                _answered(check, item, begin, output)
            if not channel.serving:
                return [f"{type(channel).__name__} says not serving: {channel.reason}"]
    return []


def _network(
    address: str,
    pool: list[PoolRequest],
    deadline: float,
    rng: random.Random,
    check: Check,
    lease: Sequence[str],
    device: torch.device,
) -> list[str]:
    with ExecutorClient(address, timeout=120, device_path=False) as client:
        return _reopened(
            lambda leased: client.open_network_channel(device, adapters=leased),
            lambda channel, layer, hidden, segments: channel.forward(layer, hidden, segments)[0],
            pool, deadline, rng, check, lease, str(device),
        )  # fmt: skip


def _spin(
    address: str,
    pool: list[PoolRequest],
    deadline: float,
    rng: random.Random,
    check: Check,
    lease: Sequence[str],
    ring_shape: tuple[int, int],
) -> list[str]:
    """``ring_shape``: (hidden size, largest T) of the ring's slots."""
    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    hidden_size, max_tokens = ring_shape
    with ExecutorClient(address, timeout=120, device_path=False) as client:
        ring_context = (
            client.cuda_memory(hidden_size, max_tokens, slots=1)
            if gpu
            else client.shared_memory(hidden_size, max_tokens, slots=1)
        )
        with ring_context as ring:

            def open_channel(leased: list[str]) -> ForwardChannel:
                channel = client.open_channel(adapters=leased, spin=True)
                if channel.block is None:
                    channel.close()
                    raise RuntimeError("the executor gave the channel no spin block")
                return channel

            return _reopened(
                open_channel,
                lambda channel, layer, hidden, segments: channel.forward(
                    layer, hidden, ring, segments
                )[0],
                pool, deadline, rng, check, lease, device,
            )  # fmt: skip


async def _channel(
    address: str,
    pool: list[PoolRequest],
    deadline: float,
    rng: random.Random,
    check: Check,
    lease: Sequence[str],
    ring_shape: tuple[int, int],
) -> list[str]:
    """``ring_shape``: (hidden size, largest T) of the ring's slots."""
    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    hidden_size, max_tokens = ring_shape
    async with AsyncExecutorClient(address, timeout=120) as client:
        ring_context = (
            client.cuda_memory(hidden_size, max_tokens, slots=IN_FLIGHT)
            if gpu
            else client.shared_memory(hidden_size, max_tokens, slots=IN_FLIGHT)
        )
        async with ring_context as ring:
            while time.monotonic() < deadline:
                leased = [rng.choice(lease)] if lease else []
                channel = await client.open_channel(adapters=leased)
                try:
                    await asyncio.gather(
                        *(
                            _channel_calls(
                                channel, ring, pool, deadline, rng, check, device, leased
                            )
                            for _ in range(IN_FLIGHT)
                        )
                    )
                    if not channel.serving:
                        return [f"channel says not serving: {channel.reason}"]
                finally:
                    await channel.close()
    return []


async def _channel_calls(
    channel: AsyncForwardChannel,
    ring: ForwardRing,
    pool: list[PoolRequest],
    deadline: float,
    rng: random.Random,
    check: Check,
    device: str,
    leased: list[str],
) -> None:
    """One of the channel's overlapping callers: its share of ``CALLS_PER_CHANNEL``; the
    adapters the channel leased go by their handles."""
    handles = {adapter: f"#{i}" for i, adapter in enumerate(leased)}
    for _ in range(CALLS_PER_CHANNEL // IN_FLIGHT):
        if time.monotonic() >= deadline:
            return
        item = rng.choice(pool)
        hidden = _hidden(item, device)
        begin = time.perf_counter()
        output: torch.Tensor | MoeLoraError
        try:
            output, _ = await channel.forward(item.layer, hidden, ring, _segments(item, handles))
        except MoeLoraError as exc:
            output = exc
        _answered(check, item, begin, output)
