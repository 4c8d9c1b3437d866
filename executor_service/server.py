"""The Executor gRPC servicer: translates messages and nothing else.

Decoding, encoding and the proto ↔ dataclass mapping happen here; the work happens in the
``ForwardEngine`` and the ``AdapterManager`` of the attached ``ExecutorRuntime``. Domain errors
raised below become status codes in ``shared.grpc_server``'s interceptor; ForwardStream turns
them into per-request ``RequestError`` answers so that one bad request does not end the stream.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator

import grpc
from google.protobuf.timestamp_pb2 import Timestamp
from typing_extensions import override

from executor_service.adapters import AdapterStatus, Location
from executor_service.batch import Segment
from executor_service.engine import ForwardInput
from executor_service.registry_source import registry_status
from executor_service.runtime import ExecutorRuntime, replica_name
from moelora.v1 import executor_pb2, executor_pb2_grpc
from shared import codec, torch_codec
from shared.errors import MoeLoraError, Overloaded, Unavailable
from shared.grpc_server import internal_error_message
from shared.refs import AdapterRef
from shared.version import package_version

log = logging.getLogger(__name__)

_LOCATIONS = {
    Location.GPU: executor_pb2.ADAPTER_LOCATION_GPU,
    Location.HOST: executor_pb2.ADAPTER_LOCATION_HOST,
    Location.DISK: executor_pb2.ADAPTER_LOCATION_DISK,
    Location.NONE: executor_pb2.ADAPTER_LOCATION_UNSPECIFIED,
}


def decode_forward(request: executor_pb2.ForwardRequest) -> ForwardInput:
    """The request as the engine takes it (tensors view the message's bytes)."""
    routing = request.routing if request.HasField("routing") else None
    has_ids = routing is not None and routing.HasField("topk_ids")
    has_weights = routing is not None and routing.HasField("topk_weights")
    return ForwardInput(
        layer=request.layer,
        hidden=torch_codec.to_torch(request.hidden_states, "hidden_states"),
        segments=[Segment(s.num_tokens, s.adapter) for s in request.segments],
        topk_ids=torch_codec.to_torch(request.routing.topk_ids, "routing.topk_ids")
        if has_ids
        else None,
        topk_weights=(
            torch_codec.to_torch(request.routing.topk_weights, "routing.topk_weights")
            if has_weights
            else None
        ),
    )


def loaded_adapter(status: AdapterStatus) -> executor_pb2.LoadedAdapter:
    message = executor_pb2.LoadedAdapter(
        name=status.adapter.name,
        version=status.adapter.version,
        digest=status.adapter.digest,
        location=_LOCATIONS[status.location],
        slot=-1 if status.slot is None else status.slot,
        pinned=status.pinned,
        rank=status.rank,
        size_bytes=status.nbytes,
        in_flight=status.in_flight,
    )
    if status.last_used is not None:
        stamp = Timestamp()
        stamp.FromNanoseconds(int(status.last_used * 1e9))
        message.last_used_time.CopyFrom(stamp)
    return message


class ExecutorServicer(executor_pb2_grpc.ExecutorServicer):
    """Answers UNAVAILABLE until ``attach`` hands it the loaded runtime."""

    def __init__(self, max_streams: int = 48) -> None:
        self._runtime: ExecutorRuntime | None = None
        # Each open ForwardStream holds a handler thread: past this many, refuse new ones
        # rather than let idle or slow streams take every thread from unary calls.
        self._max_streams = max_streams
        self._streams = threading.BoundedSemaphore(max_streams)

    def attach(self, runtime: ExecutorRuntime) -> None:
        self._runtime = runtime

    @contextlib.contextmanager
    def _ready(self) -> Iterator[ExecutorRuntime]:
        """The loaded runtime; a device fault met inside becomes UNAVAILABLE naming it."""
        runtime = self._runtime
        if runtime is None:
            raise Unavailable("the executor is still loading its base model; retry shortly")
        with runtime.device.guard():
            yield runtime

    def _forward(
        self, request: executor_pb2.ForwardRequest, context: grpc.ServicerContext
    ) -> executor_pb2.ForwardResponse:
        with self._ready() as runtime:
            start = time.perf_counter()
            decoded = decode_forward(request)
            runtime.metrics.stage["decode"].observe(time.perf_counter() - start)
            prepared = runtime.engine.prepare(decoded, _slot_wait(runtime, context))
            result = runtime.scheduler.submit(prepared)
        response = executor_pb2.ForwardResponse(
            output=torch_codec.from_torch(prepared.output),
            resolved_adapters=result.resolved_adapters,
            adapters_resident=result.adapters_loaded == 0,
            adapters_loaded=result.adapters_loaded,
        )
        response.server_time_us = int((time.perf_counter() - start) * 1e6)
        return response

    @override
    def Forward(
        self, request: executor_pb2.ForwardRequest, context: grpc.ServicerContext
    ) -> executor_pb2.ForwardResponse:
        return self._forward(request, context)

    @override
    def ForwardStream(
        self,
        request_iterator: Iterator[executor_pb2.ForwardStreamRequest],
        context: grpc.ServicerContext,
    ) -> Iterator[executor_pb2.ForwardStreamResponse]:
        if not self._streams.acquire(blocking=False):
            raise Overloaded(
                f"{self._max_streams} ForwardStream streams are open, the most this executor "
                "serves at once (--max-forward-streams); retry later or use another replica",
                retry_after_ms=1000,
            )
        try:
            yield from self._answer_stream(request_iterator, context)
        except grpc.RpcError:
            if context.is_active():
                raise
            # The client closed or cancelled the stream: nothing is left to answer.
        finally:
            self._streams.release()

    def _answer_stream(
        self,
        request_iterator: Iterator[executor_pb2.ForwardStreamRequest],
        context: grpc.ServicerContext,
    ) -> Iterator[executor_pb2.ForwardStreamResponse]:
        for item in request_iterator:
            try:
                answer = self._forward(item.forward, context)
            except MoeLoraError as exc:
                error = executor_pb2.RequestError(
                    code=exc.code.value[0],
                    message=exc.message,
                    retry_after_ms=exc.retry_after_ms if isinstance(exc, Overloaded) else 0,
                )
            except Exception:
                message = internal_error_message(
                    "forward_stream_internal_error", request_id=item.request_id
                )
                error = executor_pb2.RequestError(
                    code=grpc.StatusCode.INTERNAL.value[0], message=message
                )
            else:
                yield executor_pb2.ForwardStreamResponse(request_id=item.request_id, forward=answer)
                continue
            yield executor_pb2.ForwardStreamResponse(request_id=item.request_id, error=error)

    @override
    def LoadAdapter(
        self, request: executor_pb2.LoadAdapterRequest, context: grpc.ServicerContext
    ) -> executor_pb2.LoadAdapterResponse:
        with self._ready() as runtime:
            ref = AdapterRef.parse(request.adapter, "adapter")
            status = runtime.adapters.load(ref, request.to_gpu, _slot_wait(runtime, context))
            return executor_pb2.LoadAdapterResponse(adapter=loaded_adapter(status))

    @override
    def UnloadAdapter(
        self, request: executor_pb2.UnloadAdapterRequest, context: grpc.ServicerContext
    ) -> executor_pb2.UnloadAdapterResponse:
        with self._ready() as runtime:
            ref = AdapterRef.parse(request.adapter, "adapter")
            # Requests in flight finish first, however long the caller's deadline allows.
            status = runtime.adapters.unload(ref, float(context.time_remaining()))
            return executor_pb2.UnloadAdapterResponse(adapter=loaded_adapter(status))

    @override
    def PinAdapter(
        self, request: executor_pb2.PinAdapterRequest, context: grpc.ServicerContext
    ) -> executor_pb2.PinAdapterResponse:
        with self._ready() as runtime:
            ref = AdapterRef.parse(request.adapter, "adapter")
            status = runtime.adapters.pin(ref, _slot_wait(runtime, context))
            return executor_pb2.PinAdapterResponse(adapter=loaded_adapter(status))

    @override
    def UnpinAdapter(
        self, request: executor_pb2.UnpinAdapterRequest, context: grpc.ServicerContext
    ) -> executor_pb2.UnpinAdapterResponse:
        with self._ready() as runtime:
            ref = AdapterRef.parse(request.adapter, "adapter")
            status = runtime.adapters.unpin(ref)
            return executor_pb2.UnpinAdapterResponse(adapter=loaded_adapter(status))

    @override
    def ListLoadedAdapters(
        self, request: executor_pb2.ListLoadedAdaptersRequest, context: grpc.ServicerContext
    ) -> executor_pb2.ListLoadedAdaptersResponse:
        with self._ready() as runtime:
            adapters = runtime.adapters
            stats = adapters.stats()
            return executor_pb2.ListLoadedAdaptersResponse(
                adapters=[loaded_adapter(s) for s in adapters.list_loaded()],
                num_slots=stats.num_slots,
                free_slots=stats.free_slots,
                host_cache_used_bytes=stats.host_cache_used_bytes,
            )

    @override
    def GetExecutorInfo(
        self, request: executor_pb2.GetExecutorInfoRequest, context: grpc.ServicerContext
    ) -> executor_pb2.GetExecutorInfoResponse:
        with self._ready() as runtime:
            settings, where = runtime.settings, runtime.placement
            return executor_pb2.GetExecutorInfoResponse(
                base_model=runtime.model.spec.to_proto(runtime.model.name),
                compute_dtype=codec.dtype_from_name(str(where.dtype)),
                num_slots=settings.num_slots,
                max_rank=settings.max_rank,
                device=where.device_name,
                backend=where.backend_name,
                slot_memory_bytes=runtime.adapters.stats().slot_memory_bytes,
                host_cache_bytes=settings.host_cache_bytes,
                max_tokens_per_request=settings.max_tokens_per_request,
                max_message_bytes=settings.max_message_bytes,
                server_version=package_version(),
                served_layers=sorted(runtime.model.layers),
                replica_name=replica_name(settings),
                registry=registry_status(runtime.adapters.source),
                kernel_configs=[
                    executor_pb2.KernelConfigInfo(
                        rank=c.rank, source=c.source, shape=c.shape,
                        autotune_seconds=c.autotune_seconds,
                    )
                    for c in runtime.kernel_configs
                ],
            )  # fmt: skip


def _slot_wait(runtime: ExecutorRuntime, context: grpc.ServicerContext) -> float:
    """How long an RPC may wait for GPU slots: the setting, capped by its deadline."""
    return min(runtime.settings.slot_wait_seconds, float(context.time_remaining()))
