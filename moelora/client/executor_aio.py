"""An asyncio client of the Executor (grpc.aio), for backends that keep several Forward calls
in flight from one event loop (for example two micro-batches ping-ponging between attention
and the MoE executor).

The same calls, results, errors and retry rules as ``moelora.client.executor.ExecutorClient``:
only UNAVAILABLE and ``Overloaded`` (after its hint) are retried, with jittered exponential
backoff inside the call's deadline, and only for calls that are safe to run twice.

    async with AsyncExecutorClient("127.0.0.1:50052") as client:
        a = asyncio.create_task(client.forward(3, h0, [(5, "sql:2"), (3, None)]))
        b = asyncio.create_task(client.forward(3, h1))
        first, second = await a, await b
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar, cast

import grpc
import grpc.aio

from moelora.client import keepalive
from moelora.client.auth import bearer_metadata
from moelora.client.cuda_ring import CudaMemoryRing
from moelora.client.device_path import MESSAGE
from moelora.client.device_path_aio import AsyncDevicePath
from moelora.client.errors import MoeLoraError, Unavailable, from_rpc_error
from moelora.client.executor import (
    Array,
    ForwardCall,
    ForwardResult,
    RetryPolicy,
    RoutingTensors,
    Segments,
    channel_options,
    forward_request,
    forward_result,
    is_cuda,
    retry_pause,
    shared_forward_request,
    shared_region_name,
    stream_error,
)
from moelora.client.shared_memory import ForwardRing, SharedMemoryRing, settle
from moelora.v1 import executor_pb2, executor_pb2_grpc

if TYPE_CHECKING:
    import torch

    from moelora.client.channel_aio import AsyncForwardChannel
    from moelora.client.network_channel_aio import AsyncNetworkChannel

T = TypeVar("T")


class AsyncExecutorClient:
    """Typed asyncio calls to one executor. ``timeout`` is each call's default deadline."""

    def __init__(
        self,
        address: str,
        timeout: float = 30.0,
        tls: bool = False,
        root_certificates: bytes | None = None,
        max_message_bytes: int = 512 * 1024 * 1024,
        retry: RetryPolicy | None = None,
        token: str | None = None,
        keepalive_seconds: float = keepalive.DEFAULT_KEEPALIVE_SECONDS,
        device_path: bool = True,
        device_ring_tokens: int = 1024,
        device_ring_slots: int = 8,
    ) -> None:
        """Arguments as ``ExecutorClient``'s. ``device_path``: CUDA tensors go through a
        registered CUDA ring and one asyncio direct channel where the executor can map them
        (``moelora.client.device_path_aio``), else as bytes."""
        options = channel_options(max_message_bytes, keepalive_seconds)
        if tls or root_certificates is not None:
            credentials = grpc.ssl_channel_credentials(root_certificates=root_certificates)
            self._channel = grpc.aio.secure_channel(address, credentials, options=options)
        else:
            self._channel = grpc.aio.insecure_channel(address, options=options)
        self._stub = executor_pb2_grpc.ExecutorStub(self._channel)
        self._metadata = bearer_metadata(token) if token else None
        self.address = address
        self.timeout = timeout
        self.retry = retry or RetryPolicy()
        self._device_path = (
            AsyncDevicePath(self, device_ring_tokens, device_ring_slots) if device_path else None
        )

    @property
    def transport(self) -> str:
        """How calls with CUDA tensors travel now: "message", "cuda_memory" or
        "cuda_memory+channel" (as ``ExecutorClient.transport``)."""
        return MESSAGE if self._device_path is None else self._device_path.transport

    async def __aenter__(self) -> AsyncExecutorClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        if self._device_path is not None:
            await self._device_path.close()
        await self._channel.close()

    async def wait_until_serving(self, timeout: float = 60.0) -> None:
        """Waits until GetExecutorInfo answers (the base model is loaded)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                await self.get_executor_info(timeout=max(0.5, deadline - time.monotonic()))
                return
            except Unavailable:
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(0.1)

    # -- compute -------------------------------------------------------------------------

    async def forward(
        self,
        layer: int,
        hidden: Array,
        segments: Segments | None = None,
        routing: RoutingTensors[Array] | None = None,
        timeout: float | None = None,
        ring: ForwardRing | None = None,
    ) -> ForwardResult[Array]:
        """One MoE layer for ``hidden`` (T, H), as ``ExecutorClient.forward``."""
        path = self._device_path
        if path is not None and ring is None and routing is None and is_cuda(hidden):
            on_device = await path.forward(layer, cast("torch.Tensor", hidden), segments, timeout)
            if on_device is not None:
                return cast(ForwardResult[Array], on_device)
        slot = None if ring is None else ring.take(hidden)
        if ring is None or slot is None:
            request = forward_request(layer, hidden, segments, routing)
            response: executor_pb2.ForwardResponse = await self._call(
                self._stub.Forward, request, timeout, idempotent=True
            )
            return forward_result(response, hidden)
        failure: BaseException | None = None
        try:
            shared = shared_forward_request(ring, slot, layer, hidden, segments, routing)
            response = await self._call(self._stub.Forward, shared, timeout, idempotent=True)
            return forward_result(response, hidden, ring.output(slot, hidden))
        except BaseException as exc:
            failure = exc
            raise
        finally:
            settle(ring, slot, failure)

    @contextlib.asynccontextmanager
    async def shared_memory(
        self,
        hidden_size: int,
        max_tokens: int,
        slots: int = 4,
        dtype: str = "bfloat16",
        timeout: float | None = None,
    ) -> AsyncIterator[SharedMemoryRing]:
        """A registered shared-memory ring for ``forward(..., ring=ring)``, as
        ``ExecutorClient.shared_memory``."""
        ring = SharedMemoryRing(shared_region_name(), hidden_size, max_tokens, slots, dtype)
        try:
            await self._call(
                self._stub.RegisterSharedMemory, ring.register_request(), timeout, idempotent=True
            )
            try:
                yield ring
            finally:
                with contextlib.suppress(MoeLoraError):
                    await self._call(
                        self._stub.UnregisterSharedMemory,
                        executor_pb2.UnregisterSharedMemoryRequest(region=ring.region),
                        timeout,
                        idempotent=True,
                    )
        finally:
            ring.close()

    @contextlib.asynccontextmanager
    async def cuda_memory(
        self,
        hidden_size: int,
        max_tokens: int,
        device: torch.device | str = "cuda",
        slots: int = 4,
        dtype: str = "bfloat16",
        timeout: float | None = None,
    ) -> AsyncIterator[CudaMemoryRing]:
        """A registered CUDA-memory ring for ``forward(..., ring=ring)``, as
        ``ExecutorClient.cuda_memory``."""
        ring = await self.register_cuda_ring(hidden_size, max_tokens, device, slots, dtype, timeout)
        try:
            yield ring
        finally:
            with contextlib.suppress(MoeLoraError):
                await self.unregister_cuda_ring(ring, timeout)
            ring.close()

    async def register_cuda_ring(
        self,
        hidden_size: int,
        max_tokens: int,
        device: torch.device | str = "cuda",
        slots: int = 4,
        dtype: str = "bfloat16",
        timeout: float | None = None,
    ) -> CudaMemoryRing:
        """``cuda_memory``'s ring, registered until ``unregister_cuda_ring`` (then close it)."""
        import torch

        ring = CudaMemoryRing(
            shared_region_name(), hidden_size, max_tokens, torch.device(device), slots, dtype
        )
        try:
            await self._call(
                self._stub.RegisterCudaMemory, ring.register_request(), timeout, idempotent=True
            )
        except BaseException:
            ring.close()
            raise
        return ring

    async def unregister_cuda_ring(
        self, ring: CudaMemoryRing, timeout: float | None = None
    ) -> None:
        await self._call(
            self._stub.UnregisterCudaMemory,
            executor_pb2.UnregisterCudaMemoryRequest(region=ring.region),
            timeout,
            idempotent=True,
        )

    async def open_channel(
        self,
        timeout: float | None = None,
        slot_wait: float = 10.0,
        adapters: Sequence[str] = (),
    ) -> AsyncForwardChannel:
        """A direct channel to the executor's engine, as ``ExecutorClient.open_channel``;
        its calls may overlap (``moelora.client.channel_aio``)."""
        from moelora.client.channel_aio import AsyncForwardChannel

        request = executor_pb2.OpenChannelRequest(adapters=list(adapters))
        opened: executor_pb2.OpenChannelResponse = await self._call(
            self._stub.OpenChannel, request, timeout, idempotent=not adapters
        )
        return await AsyncForwardChannel.connect(opened, timeout or self.timeout, slot_wait)

    async def open_network_channel(
        self,
        device: torch.device,
        timeout: float | None = None,
        slot_wait: float = 10.0,
        adapters: Sequence[str] = (),
    ) -> AsyncNetworkChannel:
        """A network channel to the executor's engine, as
        ``ExecutorClient.open_network_channel``; one call at a time on it
        (``moelora.client.network_channel_aio``)."""
        from moelora.client.network_channel_aio import AsyncNetworkChannel

        request = executor_pb2.OpenChannelRequest(adapters=list(adapters), network=True)
        opened: executor_pb2.OpenChannelResponse = await self._call(
            self._stub.OpenChannel, request, timeout, idempotent=not adapters
        )
        return await AsyncNetworkChannel.connect(opened, device, timeout or self.timeout, slot_wait)

    async def forward_stream(
        self, calls: Iterable[ForwardCall[Array]], timeout: float | None = None
    ) -> AsyncIterator[ForwardResult[Array] | MoeLoraError]:
        """Pipelines ``calls`` over one stream; yields, in order, each call's result or the
        error that failed only that call. Not retried (its requests may have run)."""
        listed = list(calls)
        requests = [
            executor_pb2.ForwardStreamRequest(
                request_id=i, forward=forward_request(c.layer, c.hidden, c.segments, c.routing)
            )
            for i, c in enumerate(listed)
        ]
        call = self._stub.ForwardStream(
            iter(requests), timeout=timeout or self.timeout, metadata=self._metadata
        )
        try:
            async for answer in call:
                if answer.HasField("error"):
                    yield stream_error(answer.error)
                else:
                    yield forward_result(answer.forward, listed[answer.request_id].hidden)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None

    # -- admin ---------------------------------------------------------------------------

    async def load_adapter(
        self, adapter: str, to_gpu: bool = False, timeout: float | None = None
    ) -> executor_pb2.LoadedAdapter:
        request = executor_pb2.LoadAdapterRequest(adapter=adapter, to_gpu=to_gpu)
        response: executor_pb2.LoadAdapterResponse = await self._call(
            self._stub.LoadAdapter, request, timeout, idempotent=True
        )
        return response.adapter

    async def unload_adapter(
        self, adapter: str, timeout: float | None = None
    ) -> executor_pb2.LoadedAdapter:
        request = executor_pb2.UnloadAdapterRequest(adapter=adapter)
        response: executor_pb2.UnloadAdapterResponse = await self._call(
            self._stub.UnloadAdapter, request, timeout, idempotent=False
        )
        return response.adapter

    async def pin_adapter(
        self, adapter: str, timeout: float | None = None
    ) -> executor_pb2.LoadedAdapter:
        request = executor_pb2.PinAdapterRequest(adapter=adapter)
        response: executor_pb2.PinAdapterResponse = await self._call(
            self._stub.PinAdapter, request, timeout, idempotent=True
        )
        return response.adapter

    async def unpin_adapter(
        self, adapter: str, timeout: float | None = None
    ) -> executor_pb2.LoadedAdapter:
        request = executor_pb2.UnpinAdapterRequest(adapter=adapter)
        response: executor_pb2.UnpinAdapterResponse = await self._call(
            self._stub.UnpinAdapter, request, timeout, idempotent=True
        )
        return response.adapter

    async def list_loaded_adapters(
        self, timeout: float | None = None
    ) -> executor_pb2.ListLoadedAdaptersResponse:
        request = executor_pb2.ListLoadedAdaptersRequest()
        response: executor_pb2.ListLoadedAdaptersResponse = await self._call(
            self._stub.ListLoadedAdapters, request, timeout, idempotent=True
        )
        return response

    async def get_executor_info(
        self, timeout: float | None = None
    ) -> executor_pb2.GetExecutorInfoResponse:
        request = executor_pb2.GetExecutorInfoRequest()
        response: executor_pb2.GetExecutorInfoResponse = await self._call(
            self._stub.GetExecutorInfo, request, timeout, idempotent=True
        )
        return response

    # -- plumbing ------------------------------------------------------------------------

    async def _call(
        self,
        method: Callable[..., Awaitable[Any]],
        request: object,
        timeout: float | None,
        idempotent: bool,
    ) -> Any:
        deadline = time.monotonic() + (timeout or self.timeout)
        attempts = self.retry.attempts if idempotent else 1
        backoff = self.retry.initial_backoff
        attempt = 1
        while True:
            remaining = deadline - time.monotonic()
            try:
                return await method(request, timeout=max(remaining, 0.001), metadata=self._metadata)
            except grpc.RpcError as exc:
                error = from_rpc_error(exc)
                pause = retry_pause(error, backoff)
                if pause is None or attempt >= attempts or time.monotonic() + pause >= deadline:
                    raise error from None
            await asyncio.sleep(pause)
            attempt += 1
            backoff = min(backoff * 2, self.retry.max_backoff)
