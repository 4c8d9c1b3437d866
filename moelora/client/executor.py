"""A Python client of the Executor for backends: numpy arrays or torch tensors in, the same
kind out (torch is needed only for torch tensors, bfloat16 among them), deadlines on every
call, retries only where they are safe, errors as ``moelora.client.errors`` classes.

Retries: a call is retried only on UNAVAILABLE (the server drains, is still loading, or the
connection failed) and on ``Overloaded`` (RESOURCE_EXHAUSTED with a retry hint: too many
requests queued; waiting at least the hint), with exponential backoff inside the call's
deadline, and only when running
it twice does no harm. Forward is a pure function of its request, and Load/Pin/Unpin leave the
same state however often they run, so those retry. UnloadAdapter does not (a retry after a
first attempt that did run would answer NOT_FOUND), nor does ForwardStream (its requests may
have run).

    with ExecutorClient("127.0.0.1:50052") as client:
        result = client.forward(layer=3, hidden=h, segments=[(5, "sql:2"), (3, None)])
        result.output  # (8, H), h's kind (numpy array or torch tensor) and dtype
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast

import grpc
import numpy as np

from moelora.client import keepalive
from moelora.client import tensors as codec
from moelora.client.auth import open_channel
from moelora.client.cuda_ring import CudaMemoryRing
from moelora.client.device_path import MESSAGE, DevicePath
from moelora.client.errors import MoeLoraError, Overloaded, error_for_code, from_rpc_error
from moelora.client.health import wait_until_serving
from moelora.client.shared_memory import ForwardRing, SharedMemoryRing, Slot, settle
from moelora.v1 import executor_pb2, executor_pb2_grpc, tensor_pb2

if TYPE_CHECKING:
    import torch

    from moelora.client.channel import ForwardChannel
    from moelora.client.network_channel import NetworkChannel

T = TypeVar("T")
#: What Forward takes and gives back: numpy arrays, or torch tensors (any device, bfloat16 too).
#: A bound rather than constraints: where torch is not installed, its half is Any, and the
#: answer's type must still follow the argument's.
Array = TypeVar("Array", bound="np.ndarray[Any, Any] | torch.Tensor")

#: (num_tokens, adapter reference or None for the base model), in token order.
Segments = Sequence[tuple[int, str | None]]
#: Precomputed routing: topk_ids (T, k) int32/int64 and topk_weights (T, k) float32.
RoutingTensors = tuple[Array, Array]

_CODES = {code.value[0]: code for code in grpc.StatusCode}


@dataclass(frozen=True)
class ForwardResult(Generic[Array]):
    """Forward's answer: output (T, H) on the CPU, of the input's kind and dtype (writable,
    owning its memory); ``name:VERSION`` per segment ("" for base segments); time spent in the
    executor."""

    output: Array
    resolved_adapters: list[str]
    server_time_us: int
    #: Every adapter was already in a GPU slot; how many this request loaded.
    adapters_resident: bool = True
    adapters_loaded: int = 0


@dataclass(frozen=True)
class ForwardCall(Generic[Array]):
    """One request of ``ExecutorClient.forward_stream``."""

    layer: int
    hidden: Array
    segments: Segments | None = None
    routing: RoutingTensors[Array] | None = None


@dataclass(frozen=True)
class RetryPolicy:
    """Attempts in all (1 = no retry) and the backoff between them (doubling, jittered)."""

    attempts: int = 4
    initial_backoff: float = 0.05
    max_backoff: float = 1.0


def retry_pause(error: MoeLoraError, backoff: float) -> float | None:
    """Seconds to wait before retrying after ``error`` (jittered ``backoff``, at least an
    ``Overloaded`` error's hint); None when the error is not worth a retry."""
    pause = random.uniform(backoff / 2, backoff)
    if isinstance(error, Overloaded):
        return max(pause, error.retry_after_ms / 1000)
    if error.code is grpc.StatusCode.UNAVAILABLE:
        return pause
    return None


def stream_error(error: executor_pb2.RequestError) -> MoeLoraError:
    """A ForwardStream request's error as the domain error."""
    code = _CODES.get(error.code, grpc.StatusCode.UNKNOWN)
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED and error.retry_after_ms > 0:
        return Overloaded(error.message, error.retry_after_ms)
    return error_for_code(code, error.message)


def encode(array: np.ndarray[Any, Any] | torch.Tensor) -> tensor_pb2.Tensor:
    """A numpy array or torch tensor on the wire (torch imported only for torch tensors)."""
    if isinstance(array, np.ndarray):
        return codec.from_numpy(array)
    from moelora.client import torch_tensors as torch_codec

    return torch_codec.from_torch(array)


def decode(message: tensor_pb2.Tensor, like: Array) -> Array:
    """``message`` as ``like``'s kind, writable and owning its memory."""
    if isinstance(like, np.ndarray):
        return cast(Array, codec.to_numpy(message, "output").copy())
    from moelora.client import torch_tensors as torch_codec

    return cast(Array, torch_codec.to_torch(message, "output").clone())


def forward_request(
    layer: int,
    hidden: Array,
    segments: Segments | None = None,
    routing: RoutingTensors[Array] | None = None,
) -> executor_pb2.ForwardRequest:
    """The ForwardRequest message for numpy or torch inputs."""
    request = executor_pb2.ForwardRequest(
        layer=layer,
        hidden_states=encode(hidden),
        segments=[
            executor_pb2.Segment(num_tokens=n, adapter=ref or "") for n, ref in segments or ()
        ],
    )
    if routing is not None:
        ids, weights = routing
        request.routing.topk_ids.CopyFrom(encode(ids))
        request.routing.topk_weights.CopyFrom(encode(weights))
    return request


def channel_options(max_message_bytes: int, keepalive_seconds: float) -> list[tuple[str, int]]:
    """gRPC channel options that let messages up to ``max_message_bytes`` through both ways
    and find a connection gone silent within twice ``keepalive_seconds`` while a call is open
    (``moelora/client/keepalive.py``)."""
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        *keepalive.client_options(keepalive_seconds),
    ]


def shared_forward_request(
    ring: ForwardRing,
    slot: Slot,
    layer: int,
    hidden: Array,
    segments: Segments | None = None,
    routing: RoutingTensors[Array] | None = None,
) -> executor_pb2.ForwardRequest:
    """The ForwardRequest naming ``slot`` of ``ring`` (``hidden`` written there)."""
    wire_segments = [
        executor_pb2.Segment(num_tokens=n, adapter=ref or "") for n, ref in segments or ()
    ]
    request = ring.request(slot, hidden, layer, wire_segments)
    if routing is not None:
        ids, weights = routing
        request.routing.topk_ids.CopyFrom(encode(ids))
        request.routing.topk_weights.CopyFrom(encode(weights))
    return request


def is_cuda(array: object) -> bool:
    """Whether ``array`` is a CUDA tensor (without importing torch)."""
    return bool(getattr(array, "is_cuda", False))


def shared_region_name() -> str:
    """A region name of this process no other ring of it takes."""
    return f"ring-{os.getpid()}-{next(_RING_NUMBERS)}"


_RING_NUMBERS = itertools.count(1)


def forward_result(
    response: executor_pb2.ForwardResponse, like: Array, output: Array | None = None
) -> ForwardResult[Array]:
    """The answer; ``output`` when the executor wrote it into shared memory."""
    return ForwardResult(
        output=decode(response.output, like) if output is None else output,
        resolved_adapters=list(response.resolved_adapters),
        server_time_us=response.server_time_us,
        adapters_resident=response.adapters_resident,
        adapters_loaded=response.adapters_loaded,
    )


class ExecutorClient:
    """Typed calls to one executor. ``timeout`` is each call's default deadline in seconds."""

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
        spin_channels: bool = True,
    ) -> None:
        """``token``: the bearer token every call carries (an executor with auth on wants
        read for Forward and the listings, admin for Load/Unload/Pin/Unpin); ``tls`` with the
        system roots, or ``root_certificates`` (PEM) when given; ``keepalive_seconds``: a
        connection silent this long while a call is open is pinged, and fails its calls
        UNAVAILABLE when the ping is not answered within as long again (a ForwardStream over
        a dead connection does not wait for its deadline). ``device_path``: CUDA tensors go
        through a registered CUDA ring and a direct channel when the executor is on this host
        and can map them (``moelora.client.device_path``; ``device_ring_tokens`` rows per slot,
        ``device_ring_slots`` calls at once), else over a network channel where the executor
        takes them, else as bytes. ``spin_channels``: the device path's direct channels ask
        for spin blocks (no system call per call; a core busy while a call waits): turn it off
        on a host short of cores."""
        self._channel = open_channel(
            address,
            token=token,
            tls=tls,
            root_certificates=root_certificates,
            options=channel_options(max_message_bytes, keepalive_seconds),
        )
        self._stub = executor_pb2_grpc.ExecutorStub(self._channel)
        self.address = address
        self.timeout = timeout
        self.retry = retry or RetryPolicy()
        self._device_path = (
            DevicePath(self, device_ring_tokens, device_ring_slots, spin_channels)
            if device_path
            else None
        )

    @property
    def transport(self) -> str:
        """How calls with CUDA tensors travel now: "message" (bytes in the RPC, and the only
        way for host arrays), "cuda_memory" (a registered CUDA ring, descriptors over gRPC),
        "cuda_memory+channel" (the ring and a direct channel, no gRPC call each) or
        "network_channel" (a network channel per thread: NCCL, no gRPC call each)."""
        return MESSAGE if self._device_path is None else self._device_path.transport

    def __enter__(self) -> ExecutorClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        if self._device_path is not None:
            self._device_path.close()
        self._channel.close()

    def wait_until_serving(self, timeout: float = 60.0) -> None:
        """Blocks until health says SERVING (the base model is loaded)."""
        wait_until_serving(self._channel, "moelora.v1.Executor", timeout=timeout)

    # -- compute -------------------------------------------------------------------------

    def forward(
        self,
        layer: int,
        hidden: Array,
        segments: Segments | None = None,
        routing: RoutingTensors[Array] | None = None,
        timeout: float | None = None,
        ring: ForwardRing | None = None,
    ) -> ForwardResult[Array]:
        """One MoE layer for ``hidden`` (T, H): a numpy array (float32/float16) or a torch
        tensor (bfloat16 too); the output is of the same kind and dtype. ``segments`` cover
        the T tokens in order; None = all tokens on the base model. ``ring`` (from
        ``shared_memory`` or ``cuda_memory``): the tensors travel through it where a slot
        fits them."""
        path = self._device_path
        if path is not None and ring is None and routing is None and is_cuda(hidden):
            on_device = path.forward(layer, cast("torch.Tensor", hidden), segments, timeout)
            if on_device is not None:
                return cast(ForwardResult[Array], on_device)
        slot = None if ring is None else ring.take(hidden)
        if ring is None or slot is None:
            request = forward_request(layer, hidden, segments, routing)
            response: executor_pb2.ForwardResponse = self._call(
                self._stub.Forward, request, timeout, idempotent=True
            )
            return forward_result(response, hidden)
        failure: BaseException | None = None
        try:
            shared = shared_forward_request(ring, slot, layer, hidden, segments, routing)
            response = self._call(self._stub.Forward, shared, timeout, idempotent=True)
            return forward_result(response, hidden, ring.output(slot, hidden))
        except BaseException as exc:
            failure = exc
            raise
        finally:
            settle(ring, slot, failure)

    @contextlib.contextmanager
    def shared_memory(
        self,
        hidden_size: int,
        max_tokens: int,
        slots: int = 4,
        dtype: str = "bfloat16",
        timeout: float | None = None,
    ) -> Iterator[SharedMemoryRing]:
        """A ring of ``slots`` Forward slots in shared memory, registered with the executor
        (same host only) while the block runs: ``forward(..., ring=ring)`` then sends
        descriptors instead of the tensors (see ``moelora.client.shared_memory``). ``dtype`` is
        the inputs' (and outputs') dtype; ``max_tokens`` the largest T a slot holds."""
        ring = SharedMemoryRing(shared_region_name(), hidden_size, max_tokens, slots, dtype)
        try:
            self._call(
                self._stub.RegisterSharedMemory, ring.register_request(), timeout, idempotent=True
            )
            try:
                yield ring
            finally:
                with contextlib.suppress(MoeLoraError):
                    self._call(
                        self._stub.UnregisterSharedMemory,
                        executor_pb2.UnregisterSharedMemoryRequest(region=ring.region),
                        timeout,
                        idempotent=True,
                    )
        finally:
            ring.close()

    @contextlib.contextmanager
    def cuda_memory(
        self,
        hidden_size: int,
        max_tokens: int,
        device: torch.device | str = "cuda",
        slots: int = 4,
        dtype: str = "bfloat16",
        timeout: float | None = None,
    ) -> Iterator[CudaMemoryRing]:
        """A ring of ``slots`` Forward slots in CUDA memory on ``device``, registered with the
        executor (same host; its GPU or one it reaches by a peer link) while the block runs:
        ``forward(..., ring=ring)`` with torch tensors then sends descriptors, and the tensors
        stay on the GPUs (see ``moelora.client.cuda_ring``)."""
        ring = self.register_cuda_ring(hidden_size, max_tokens, device, slots, dtype, timeout)
        try:
            yield ring
        finally:
            with contextlib.suppress(MoeLoraError):
                self.unregister_cuda_ring(ring, timeout)
            ring.close()

    def register_cuda_ring(
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
            self._call(
                self._stub.RegisterCudaMemory, ring.register_request(), timeout, idempotent=True
            )
        except BaseException:
            ring.close()
            raise
        return ring

    def unregister_cuda_ring(self, ring: CudaMemoryRing, timeout: float | None = None) -> None:
        self._call(
            self._stub.UnregisterCudaMemory,
            executor_pb2.UnregisterCudaMemoryRequest(region=ring.region),
            timeout,
            idempotent=True,
        )

    def open_channel(
        self,
        timeout: float | None = None,
        slot_wait: float = 10.0,
        adapters: Sequence[str] = (),
        spin: bool = False,
    ) -> ForwardChannel:
        """A direct channel to the executor's engine (same host; see
        ``moelora.client.channel``): Forward through a registered ring with no gRPC call
        each. ``timeout`` bounds this call and each of the channel's. ``adapters`` are leased
        for the channel's life: in GPU slots until it closes (``channel.leased`` says which
        versions). ``spin``: descriptors and answers through memory shared with the engine,
        polled by both (one call in flight; the caller's core busy while it waits), where
        the executor spins (``--channel-spin-us``)."""
        from moelora.client.channel import ForwardChannel

        request = executor_pb2.OpenChannelRequest(adapters=list(adapters))
        # Not retried with a lease: one taken by an attempt whose answer was lost would stay
        # held until its ticket expired.
        opened: executor_pb2.OpenChannelResponse = self._call(
            self._stub.OpenChannel, request, timeout, idempotent=not adapters
        )
        return ForwardChannel(opened, timeout or self.timeout, slot_wait, spin)

    def open_network_channel(
        self,
        device: torch.device,
        timeout: float | None = None,
        slot_wait: float = 10.0,
        adapters: Sequence[str] = (),
    ) -> NetworkChannel:
        """A network channel to the executor's engine (any host; see
        ``moelora.client.network_channel``): Forward for tensors on ``device`` with the bytes
        moved over a process group of the channel's own (NCCL between GPUs) and no gRPC call
        each. ``timeout`` bounds this call and each of the channel's; ``adapters`` are leased
        as for ``open_channel``. FailedPrecondition where the executor takes none."""
        from moelora.client.network_channel import NetworkChannel

        request = executor_pb2.OpenChannelRequest(adapters=list(adapters), network=True)
        opened: executor_pb2.OpenChannelResponse = self._call(
            self._stub.OpenChannel, request, timeout, idempotent=not adapters
        )
        return NetworkChannel(opened, device, timeout or self.timeout, slot_wait)

    def forward_stream(
        self, calls: Iterable[ForwardCall[Array]], timeout: float | None = None
    ) -> Iterator[ForwardResult[Array] | MoeLoraError]:
        """Pipelines ``calls`` over one stream; yields, in order, each call's result or the
        error that failed only that call. ``timeout`` bounds the whole stream."""

        likes: list[Array] = []  # each call's input, to answer in its kind

        def requests() -> Iterator[executor_pb2.ForwardStreamRequest]:
            for request_id, call in enumerate(calls):
                likes.append(call.hidden)
                forward = forward_request(call.layer, call.hidden, call.segments, call.routing)
                yield executor_pb2.ForwardStreamRequest(request_id=request_id, forward=forward)

        try:
            for answer in self._stub.ForwardStream(requests(), timeout=timeout or self.timeout):
                if answer.HasField("error"):
                    yield stream_error(answer.error)
                else:
                    yield forward_result(answer.forward, likes[answer.request_id])
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None

    # -- admin ---------------------------------------------------------------------------

    def load_adapter(
        self, adapter: str, to_gpu: bool = False, timeout: float | None = None
    ) -> executor_pb2.LoadedAdapter:
        request = executor_pb2.LoadAdapterRequest(adapter=adapter, to_gpu=to_gpu)
        response: executor_pb2.LoadAdapterResponse = self._call(
            self._stub.LoadAdapter, request, timeout, idempotent=True
        )
        return response.adapter

    def unload_adapter(
        self, adapter: str, timeout: float | None = None
    ) -> executor_pb2.LoadedAdapter:
        request = executor_pb2.UnloadAdapterRequest(adapter=adapter)
        response: executor_pb2.UnloadAdapterResponse = self._call(
            self._stub.UnloadAdapter, request, timeout, idempotent=False
        )
        return response.adapter

    def pin_adapter(self, adapter: str, timeout: float | None = None) -> executor_pb2.LoadedAdapter:
        request = executor_pb2.PinAdapterRequest(adapter=adapter)
        response: executor_pb2.PinAdapterResponse = self._call(
            self._stub.PinAdapter, request, timeout, idempotent=True
        )
        return response.adapter

    def unpin_adapter(
        self, adapter: str, timeout: float | None = None
    ) -> executor_pb2.LoadedAdapter:
        request = executor_pb2.UnpinAdapterRequest(adapter=adapter)
        response: executor_pb2.UnpinAdapterResponse = self._call(
            self._stub.UnpinAdapter, request, timeout, idempotent=True
        )
        return response.adapter

    def list_loaded_adapters(
        self, timeout: float | None = None
    ) -> executor_pb2.ListLoadedAdaptersResponse:
        request = executor_pb2.ListLoadedAdaptersRequest()
        response: executor_pb2.ListLoadedAdaptersResponse = self._call(
            self._stub.ListLoadedAdapters, request, timeout, idempotent=True
        )
        return response

    def get_executor_info(
        self, timeout: float | None = None
    ) -> executor_pb2.GetExecutorInfoResponse:
        request = executor_pb2.GetExecutorInfoRequest()
        response: executor_pb2.GetExecutorInfoResponse = self._call(
            self._stub.GetExecutorInfo, request, timeout, idempotent=True
        )
        return response

    # -- plumbing ------------------------------------------------------------------------

    def _call(
        self,
        method: Callable[..., T],
        request: object,
        timeout: float | None,
        idempotent: bool,
    ) -> T:
        deadline = time.monotonic() + (timeout or self.timeout)
        attempts = self.retry.attempts if idempotent else 1
        backoff = self.retry.initial_backoff
        attempt = 1
        while True:
            remaining = deadline - time.monotonic()
            try:
                return method(request, timeout=max(remaining, 0.001))
            except grpc.RpcError as exc:
                error = from_rpc_error(exc)
                pause = retry_pause(error, backoff)
                if pause is None or attempt >= attempts or time.monotonic() + pause >= deadline:
                    raise error from None
            time.sleep(pause)
            attempt += 1
            backoff = min(backoff * 2, self.retry.max_backoff)
