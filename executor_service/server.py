"""The Executor gRPC servicer, as a front end runs it: messages in, the engine's answers out.

A Forward request's tensors are checked for size and copied once, straight from the message's
bytes, into the front end's shared-memory arena; the engine gets a small descriptor over the
``EngineLink`` and writes the answer into a region of the same arena, from which the response
is encoded. The work (validation against the model, adapters, batching, the GPU) happens in the
engine (``serving/engine_host.py``); admin calls are forwarded to it as they are. Domain errors
become status codes in ``shared.grpc_server``'s interceptor; ForwardStream turns them into
per-request ``RequestError`` answers so that one bad request does not end the stream.
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
from google.protobuf.timestamp_pb2 import Timestamp
from typing_extensions import override

from executor_service.config import ExecutorSettings
from executor_service.serving.arena import Arena, ArenaFull, Region
from executor_service.serving.combiner import Combiner, combine_limits
from executor_service.serving.engine_link import EngineLink
from moelora.client import tensors as codec
from moelora.client.engine_wire import ForwardDescriptor, TensorRef, raise_for
from moelora.client.errors import (
    FailedPrecondition,
    InvalidArgument,
    MoeLoraError,
    Overloaded,
    ResourceExhausted,
)
from moelora.client.model_spec import ModelSpec
from moelora.v1 import executor_pb2, executor_pb2_grpc, tensor_pb2
from shared.grpc_server import internal_error_message

log = logging.getLogger(__name__)

_LOCATIONS = {
    "gpu": executor_pb2.ADAPTER_LOCATION_GPU,
    "host": executor_pb2.ADAPTER_LOCATION_HOST,
    "disk": executor_pb2.ADAPTER_LOCATION_DISK,
    "none": executor_pb2.ADAPTER_LOCATION_UNSPECIFIED,
}

#: How long a request waits for room in the front end's arena before RESOURCE_EXHAUSTED.
_ARENA_WAIT_SECONDS = 5.0


def registry_status_message(status: dict[str, Any] | None) -> executor_pb2.RegistryStatus | None:
    """The engine's registry detail (``registry_source.registry_status``) as the message."""
    if status is None:
        return None
    message = executor_pb2.RegistryStatus(
        address=status["address"],
        reachable=status["reachable"],
        watching=status["watching"],
        staleness_seconds=status["staleness_seconds"],
    )
    if status["unreachable_since"] is not None:
        message.unreachable_since.FromNanoseconds(round(status["unreachable_since"] * 1e9))
    return message


def loaded_adapter(status: dict[str, Any]) -> executor_pb2.LoadedAdapter:
    """An adapter's status as the engine reports it (``engine_host.status_json``)."""
    message = executor_pb2.LoadedAdapter(
        name=status["name"],
        version=status["version"],
        digest=status["digest"],
        location=_LOCATIONS[status["location"]],
        slot=-1 if status["slot"] is None else status["slot"],
        pinned=status["pinned"],
        rank=status["rank"],
        size_bytes=status["nbytes"],
        in_flight=status["in_flight"],
    )
    if status["last_used"] is not None:
        stamp = Timestamp()
        stamp.FromNanoseconds(int(status["last_used"] * 1e9))
        message.last_used_time.CopyFrom(stamp)
    return message


class ExecutorServicer(executor_pb2_grpc.ExecutorServicer):
    """Forwards every RPC to the engine over ``link`` (see the module doc)."""

    def __init__(self, link: EngineLink, settings: ExecutorSettings, max_streams: int) -> None:
        self._link = link
        self._combiner = Combiner(link, combine_limits(settings))
        self._arena: Arena = link.arena
        self._settings = settings
        # Each open ForwardStream holds a handler thread: past this many, refuse new ones
        # rather than let idle or slow streams take every thread from unary calls.
        self._max_streams = max_streams
        self._streams = threading.BoundedSemaphore(max_streams)

    def _forward(
        self, request: executor_pb2.ForwardRequest, context: grpc.ServicerContext
    ) -> executor_pb2.ForwardResponse:
        start = time.perf_counter()
        regions: list[Region] = []
        shared_output = request.HasField("shared_output")
        try:
            if request.HasField("shared_hidden_states"):
                if request.hidden_states.data or request.hidden_states.shape:
                    raise InvalidArgument(
                        "hidden_states: leave it unset when shared_hidden_states names the input",
                        "hidden_states",
                    )
                hidden = _shared(request.shared_hidden_states, "shared_hidden_states")
            else:
                hidden = self._put(request.hidden_states, "hidden_states", regions)
            if shared_output:
                output = _shared(request.shared_output, "shared_output")
                if (output.dtype, output.shape) != (hidden.dtype, hidden.shape):
                    raise InvalidArgument(
                        "shared_output: must have the input's dtype and shape "
                        f"{list(hidden.shape)}",
                        "shared_output",
                    )
            else:
                output = self._reserve(hidden, regions)
                output_region = regions[-1]
            ids = weights = None
            if request.HasField("routing"):
                routing = request.routing
                ids = self._put(routing.topk_ids, "routing.topk_ids", regions)
                weights = self._put(routing.topk_weights, "routing.topk_weights", regions)
            descriptor = ForwardDescriptor(
                request_id=self._link.next_id(),
                layer=request.layer,
                slot_wait=_slot_wait(self._settings, context),
                decode_seconds=time.perf_counter() - start,
                scope=_scope(context),
                hidden=hidden,
                output=output,
                segments=tuple((s.num_tokens, s.adapter) for s in request.segments),
                topk_ids=ids,
                topk_weights=weights,
            )
            result = self._combiner.forward(descriptor)
            raise_for(result.code, result.message, result.retry_after_ms)
            if not shared_output:
                data = bytes(self._arena.view(output_region)[: output.nbytes])
        finally:
            for region in regions:
                self._arena.free(region)
        response = executor_pb2.ForwardResponse(
            resolved_adapters=list(result.resolved_adapters),
            adapters_resident=result.adapters_loaded == 0,
            adapters_loaded=result.adapters_loaded,
        )
        if not shared_output:
            response.output.CopyFrom(
                tensor_pb2.Tensor(
                    dtype=request.hidden_states.dtype, shape=list(output.shape), data=data
                )
            )
        response.server_time_us = int((time.perf_counter() - start) * 1e6)
        return response

    def _put(self, tensor: tensor_pb2.Tensor, field: str, regions: list[Region]) -> TensorRef:
        """Copies a message tensor into the arena (its size checked against its shape)."""
        shape, _ = codec.checked_shape(tensor, field)
        region = self._allocate(len(tensor.data), regions)
        self._arena.view(region)[: len(tensor.data)] = tensor.data
        return TensorRef("", region.offset, len(tensor.data), tensor.dtype, shape)

    def _reserve(self, like: TensorRef, regions: list[Region]) -> TensorRef:
        region = self._allocate(like.nbytes, regions)
        return TensorRef("", region.offset, like.nbytes, like.dtype, like.shape)

    def _allocate(self, nbytes: int, regions: list[Region]) -> Region:
        try:
            region = self._arena.allocate(nbytes, _ARENA_WAIT_SECONDS)
        except ArenaFull as exc:
            raise ResourceExhausted(
                f"hidden_states: the request's tensors do not fit the front end's shared memory "
                f"now ({exc}); send fewer tokens per request or raise --frontend-arena-bytes",
                "hidden_states",
            ) from None
        regions.append(region)
        return region

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
        wait = _slot_wait(self._settings, context)
        status = self._link.call(
            "load", {"adapter": request.adapter, "to_gpu": request.to_gpu, "wait": wait}
        )
        return executor_pb2.LoadAdapterResponse(adapter=loaded_adapter(status))

    @override
    def UnloadAdapter(
        self, request: executor_pb2.UnloadAdapterRequest, context: grpc.ServicerContext
    ) -> executor_pb2.UnloadAdapterResponse:
        # Requests in flight finish first, however long the caller's deadline allows.
        wait = float(context.time_remaining())
        status = self._link.call("unload", {"adapter": request.adapter, "wait": wait})
        return executor_pb2.UnloadAdapterResponse(adapter=loaded_adapter(status))

    @override
    def PinAdapter(
        self, request: executor_pb2.PinAdapterRequest, context: grpc.ServicerContext
    ) -> executor_pb2.PinAdapterResponse:
        wait = _slot_wait(self._settings, context)
        status = self._link.call("pin", {"adapter": request.adapter, "wait": wait})
        return executor_pb2.PinAdapterResponse(adapter=loaded_adapter(status))

    @override
    def UnpinAdapter(
        self, request: executor_pb2.UnpinAdapterRequest, context: grpc.ServicerContext
    ) -> executor_pb2.UnpinAdapterResponse:
        status = self._link.call("unpin", {"adapter": request.adapter})
        return executor_pb2.UnpinAdapterResponse(adapter=loaded_adapter(status))

    @override
    def ListLoadedAdapters(
        self, request: executor_pb2.ListLoadedAdaptersRequest, context: grpc.ServicerContext
    ) -> executor_pb2.ListLoadedAdaptersResponse:
        listing = self._link.call("list", {})
        stats = listing["stats"]
        return executor_pb2.ListLoadedAdaptersResponse(
            adapters=[loaded_adapter(s) for s in listing["adapters"]],
            num_slots=stats["num_slots"],
            free_slots=stats["free_slots"],
            host_cache_used_bytes=stats["host_cache_used_bytes"],
        )

    @override
    def GetExecutorInfo(
        self, request: executor_pb2.GetExecutorInfoRequest, context: grpc.ServicerContext
    ) -> executor_pb2.GetExecutorInfoResponse:
        info = self._link.call("info", {})
        spec = info["spec"]
        spec["moe_layers"] = tuple(spec["moe_layers"])
        return executor_pb2.GetExecutorInfoResponse(
            base_model=ModelSpec(**spec).to_proto(info["model_name"]),
            compute_dtype=codec.dtype_from_name(info["compute_dtype"]),
            weight_format=info["weight_format"],
            num_slots=info["num_slots"],
            max_rank=info["max_rank"],
            device=info["device"],
            backend=info["backend"],
            slot_memory_bytes=info["slot_memory_bytes"],
            host_cache_bytes=info["host_cache_bytes"],
            max_tokens_per_request=info["max_tokens_per_request"],
            max_message_bytes=info["max_message_bytes"],
            server_version=info["server_version"],
            served_layers=info["served_layers"],
            replica_name=info["replica_name"],
            registry=registry_status_message(info["registry"]),
            kernel_configs=[
                executor_pb2.KernelConfigInfo(
                    rank=c["rank"], source=c["source"], shape=c["shape"],
                    autotune_seconds=c["autotune_seconds"],
                )
                for c in info["kernel_configs"]
            ],
        )  # fmt: skip

    @override
    def RegisterSharedMemory(
        self, request: executor_pb2.RegisterSharedMemoryRequest, context: grpc.ServicerContext
    ) -> executor_pb2.RegisterSharedMemoryResponse:
        if not _on_this_host(context.peer()):
            raise FailedPrecondition(
                f"shared memory is for clients on the executor's host; this call came from "
                f"{context.peer()}: send the tensors' bytes instead",
                "shm_name",
            )
        region = self._link.call(
            "register_shm",
            {
                "scope": _scope(context),
                "region": request.region,
                "shm_name": request.shm_name,
                "size": request.size,
            },
        )
        return executor_pb2.RegisterSharedMemoryResponse(
            region=executor_pb2.SharedMemoryRegion(
                region=region["region"], shm_name=region["shm_name"], size=region["size"]
            )
        )

    @override
    def UnregisterSharedMemory(
        self, request: executor_pb2.UnregisterSharedMemoryRequest, context: grpc.ServicerContext
    ) -> executor_pb2.UnregisterSharedMemoryResponse:
        self._link.call(
            "unregister_region",
            {"scope": _scope(context), "region": request.region, "kind": "shm"},
        )
        return executor_pb2.UnregisterSharedMemoryResponse()

    @override
    def ListSharedMemory(
        self, request: executor_pb2.ListSharedMemoryRequest, context: grpc.ServicerContext
    ) -> executor_pb2.ListSharedMemoryResponse:
        regions = self._link.call("list_regions", {"scope": _scope(context), "kind": "shm"})
        return executor_pb2.ListSharedMemoryResponse(
            regions=[
                executor_pb2.SharedMemoryRegion(
                    region=r["region"], shm_name=r["shm_name"], size=r["size"]
                )
                for r in regions
            ]
        )

    @override
    def RegisterCudaMemory(
        self, request: executor_pb2.RegisterCudaMemoryRequest, context: grpc.ServicerContext
    ) -> executor_pb2.RegisterCudaMemoryResponse:
        if not _on_this_host(context.peer()):
            raise FailedPrecondition(
                f"CUDA memory is for clients on the executor's host; this call came from "
                f"{context.peer()}: send the tensors' bytes instead",
                "ipc_handle",
            )
        region = self._link.call(
            "register_cuda",
            {
                "scope": _scope(context),
                "region": request.region,
                "ipc_handle": request.ipc_handle.hex(),
                "device_uuid": request.device_uuid,
                "size": request.size,
            },
        )
        return executor_pb2.RegisterCudaMemoryResponse(region=_cuda_region(region))

    @override
    def UnregisterCudaMemory(
        self, request: executor_pb2.UnregisterCudaMemoryRequest, context: grpc.ServicerContext
    ) -> executor_pb2.UnregisterCudaMemoryResponse:
        self._link.call(
            "unregister_region",
            {"scope": _scope(context), "region": request.region, "kind": "cuda"},
        )
        return executor_pb2.UnregisterCudaMemoryResponse()

    @override
    def OpenChannel(
        self, request: executor_pb2.OpenChannelRequest, context: grpc.ServicerContext
    ) -> executor_pb2.OpenChannelResponse:
        if not request.network and not _on_this_host(context.peer()):
            raise FailedPrecondition(
                f"direct channels are for clients on the executor's host; this call came from "
                f"{context.peer()}: open a network channel (network: true) or call Forward",
                "channel",
            )
        opened = self._link.call(
            "open_channel",
            {
                "scope": _scope(context),
                "adapters": list(request.adapters),
                "wait": _slot_wait(self._settings, context),
                "network": request.network,
            },
        )
        return executor_pb2.OpenChannelResponse(
            socket_path=opened["socket"],
            ticket=opened["ticket"],
            max_in_flight=opened["max_in_flight"],
            leased=opened["leased"],
            network_address=opened.get("network_address", ""),
            store_address=opened.get("store_address", ""),
            backend=opened.get("backend", ""),
        )

    @override
    def ListCudaMemory(
        self, request: executor_pb2.ListCudaMemoryRequest, context: grpc.ServicerContext
    ) -> executor_pb2.ListCudaMemoryResponse:
        regions = self._link.call("list_regions", {"scope": _scope(context), "kind": "cuda"})
        return executor_pb2.ListCudaMemoryResponse(regions=[_cuda_region(r) for r in regions])


def _cuda_region(region: dict[str, Any]) -> executor_pb2.CudaMemoryRegion:
    return executor_pb2.CudaMemoryRegion(
        region=region["region"], device_uuid=region["device_uuid"], size=region["size"]
    )


def _shared(tensor: executor_pb2.SharedTensor, field: str) -> TensorRef:
    """A tensor in a registered region, as the engine takes it (bounds: the engine's)."""
    wire = codec.WIRE_TYPES.get(tensor.dtype)
    if wire is None:
        raise InvalidArgument(f"{field}.dtype: unsupported dtype {tensor.dtype}", f"{field}.dtype")
    if not tensor.region:
        raise InvalidArgument(f"{field}.region: name a registered region", f"{field}.region")
    shape = tuple(int(d) for d in tensor.shape)
    if len(shape) > codec.MAX_DIMS or math.prod(shape) > codec.MAX_ELEMENTS:
        raise InvalidArgument(f"{field}.shape: {list(shape)} is too large", f"{field}.shape")
    nbytes = math.prod(shape) * wire.itemsize
    return TensorRef(tensor.region, tensor.offset, nbytes, tensor.dtype, shape)


def _scope(context: grpc.ServicerContext) -> str:
    """Whose shared-memory regions a call may name: its bearer token's (hashed), or the
    token-less callers' when auth is off."""
    for key, value in context.invocation_metadata():
        if key == "authorization":
            raw = value.encode() if isinstance(value, str) else value
            return hashlib.sha256(raw).hexdigest()[:32]
    return ""


def _on_this_host(peer: str) -> bool:
    return peer.startswith(("unix:", "ipv4:127.", "ipv6:[::1]"))


def _slot_wait(settings: ExecutorSettings, context: grpc.ServicerContext) -> float:
    """How long an RPC may wait for GPU slots: the setting, capped by its deadline."""
    return min(settings.slot_wait_seconds, float(context.time_remaining()))
