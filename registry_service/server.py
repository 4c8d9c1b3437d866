# ruff: noqa: N802  (method names are the RPC names the proto fixes)
"""The AdapterRegistry gRPC servicer: checks the caller's role, translates
messages, calls the Registry. Domain errors become status codes in
shared/grpc_server.py's interceptor."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc

from moelora.client.errors import InvalidArgument, Unavailable
from moelora.client.model_spec import ModelSpec
from moelora.client.rpc_metadata import WATCH_START_METADATA
from moelora.v1 import registry_pb2, registry_pb2_grpc
from registry_service import messages, metrics
from registry_service.app import RegistryApp
from registry_service.auth import METHOD_ROLES
from registry_service.config import RegistrySettings
from registry_service.domain import Chunk, UploadTrailer
from registry_service.service import Registry
from registry_service.watch_quota import WatchQuota
from shared.call_limits import Lane
from shared.grpc_server import GrpcServer
from shared.tokens import MethodAuthorizer, Principal, TokenChecker

SERVICE_NAME = registry_pb2.DESCRIPTOR.services_by_name["AdapterRegistry"].full_name


class RegistryServicer(registry_pb2_grpc.AdapterRegistryServicer):
    def __init__(
        self,
        registry: Registry,
        authorizer: TokenChecker,
        draining: Callable[[], bool],
        watches: WatchQuota,
    ) -> None:
        self._registry = registry
        self._authorizer = authorizer
        self._draining = draining
        self._watches = watches

    def _caller(self, context: grpc.ServicerContext) -> Principal:
        """Who is calling (the server checked the token's role for this method already)."""
        return self._authorizer.identify(context.invocation_metadata())

    # -- base models ---------------------------------------------------------------------------

    def RegisterBaseModel(
        self, request: registry_pb2.RegisterBaseModelRequest, context: grpc.ServicerContext
    ) -> registry_pb2.RegisterBaseModelResponse:
        principal = self._caller(context)
        spec = ModelSpec.from_proto(request.base_model)
        record, created = self._registry.register_base_model(
            request.base_model.name, spec, principal.name
        )
        return registry_pb2.RegisterBaseModelResponse(
            base_model=record.spec.to_proto(record.name), created=created
        )

    def GetBaseModel(
        self, request: registry_pb2.GetBaseModelRequest, context: grpc.ServicerContext
    ) -> registry_pb2.GetBaseModelResponse:
        record = self._registry.get_base_model(request.name)
        return registry_pb2.GetBaseModelResponse(base_model=record.spec.to_proto(record.name))

    def ListBaseModels(
        self, request: registry_pb2.ListBaseModelsRequest, context: grpc.ServicerContext
    ) -> registry_pb2.ListBaseModelsResponse:
        page = self._registry.list_base_models(request.page_size, request.page_token)
        return registry_pb2.ListBaseModelsResponse(
            base_models=[r.spec.to_proto(r.name) for r in page.items],
            next_page_token=page.next_token,
        )

    # -- adapters ------------------------------------------------------------------------------

    def UploadAdapter(
        self,
        request_iterator: Iterator[registry_pb2.UploadAdapterRequest],
        context: grpc.ServicerContext,
    ) -> registry_pb2.UploadAdapterResponse:
        principal = self._caller(context)
        first = next(request_iterator, None)
        if first is None or first.WhichOneof("payload") != "header":
            raise InvalidArgument(
                "header missing: the first UploadAdapter message must carry the header", "header"
            )
        header = messages.header_from_proto(first.header)
        version = self._registry.upload(header, _chunks(request_iterator), principal.name)
        return registry_pb2.UploadAdapterResponse(version=messages.version_to_proto(version))

    def GetAdapter(
        self, request: registry_pb2.GetAdapterRequest, context: grpc.ServicerContext
    ) -> registry_pb2.GetAdapterResponse:
        version = self._registry.get(request.ref)
        return registry_pb2.GetAdapterResponse(version=messages.version_to_proto(version))

    def ListAdapters(
        self, request: registry_pb2.ListAdaptersRequest, context: grpc.ServicerContext
    ) -> registry_pb2.ListAdaptersResponse:
        page = self._registry.list_versions(
            messages.list_filter_from_proto(request), request.page_size, request.page_token
        )
        return registry_pb2.ListAdaptersResponse(
            versions=[messages.version_to_proto(v, parts=False) for v in page.items],
            next_page_token=page.next_token,
        )

    def DownloadAdapter(
        self, request: registry_pb2.DownloadAdapterRequest, context: grpc.ServicerContext
    ) -> Iterator[registry_pb2.DownloadAdapterResponse]:
        version, chunks = self._registry.download(
            request.ref, request.chunk_size, messages.range_from_proto(request)
        )
        yield registry_pb2.DownloadAdapterResponse(version=messages.version_to_proto(version))
        for chunk in chunks:
            yield registry_pb2.DownloadAdapterResponse(chunk=messages.chunk_to_proto(chunk))

    def GetDownloadUrls(
        self, request: registry_pb2.GetDownloadUrlsRequest, context: grpc.ServicerContext
    ) -> registry_pb2.GetDownloadUrlsResponse:
        presigned = self._registry.presign(request.ref, request.expires_in_seconds)
        return messages.presigned_to_proto(presigned)

    def SetAlias(
        self, request: registry_pb2.SetAliasRequest, context: grpc.ServicerContext
    ) -> registry_pb2.SetAliasResponse:
        principal = self._caller(context)
        change = self._registry.set_alias(
            request.name, request.alias, request.version, principal.name
        )
        return registry_pb2.SetAliasResponse(
            version=messages.version_to_proto(change.version),
            previous_version=change.previous_version,
        )

    def DeleteAlias(
        self, request: registry_pb2.DeleteAliasRequest, context: grpc.ServicerContext
    ) -> registry_pb2.DeleteAliasResponse:
        principal = self._caller(context)
        previous = self._registry.delete_alias(request.name, request.alias, principal.name)
        return registry_pb2.DeleteAliasResponse(previous_version=previous)

    def DeleteAdapterVersion(
        self, request: registry_pb2.DeleteAdapterVersionRequest, context: grpc.ServicerContext
    ) -> registry_pb2.DeleteAdapterVersionResponse:
        principal = self._caller(context)
        version = self._registry.delete(request.ref, principal.name, request.refuse_if_aliased)
        return registry_pb2.DeleteAdapterVersionResponse(version=messages.version_to_proto(version))

    def WatchAdapters(
        self, request: registry_pb2.WatchAdaptersRequest, context: grpc.ServicerContext
    ) -> Iterator[registry_pb2.WatchAdaptersResponse]:
        release = self._watches.acquire(self._caller(context))
        metrics.WATCH_STREAMS.inc()
        try:
            start = self._registry.watch_start(
                request.after_sequence, request.name, request.base_model
            )
            context.send_initial_metadata(((WATCH_START_METADATA, str(start)),))
            last = start

            def stop() -> bool:
                return self._draining() or not context.is_active()

            for event in self._registry.watch(start, request.name, request.base_model, stop):
                yield messages.event_to_proto(event)
                last = event.sequence
            if self._draining():
                raise Unavailable(
                    f"registry replica is draining: reconnect with after_sequence={last}"
                )
        finally:
            metrics.WATCH_STREAMS.dec()
            release()

    def GarbageCollect(
        self, request: registry_pb2.GarbageCollectRequest, context: grpc.ServicerContext
    ) -> registry_pb2.GarbageCollectResponse:
        report = self._registry.gc(request.grace_seconds or None, request.dry_run)
        return registry_pb2.GarbageCollectResponse(
            removed_blobs=report.removed_blobs,
            removed_bytes=report.removed_bytes,
            purged_versions=report.purged_versions,
        )


def _chunks(
    requests: Iterator[registry_pb2.UploadAdapterRequest],
) -> Iterator[Chunk | UploadTrailer]:
    for request in requests:
        kind: Any = request.WhichOneof("payload")
        if kind == "chunk":
            yield messages.chunk_from_proto(request.chunk)
        elif kind == "trailer":
            yield UploadTrailer(tuple(request.trailer.sha256))
        elif kind == "header":
            raise InvalidArgument("header repeated: only the first message carries it", "header")
        else:
            raise InvalidArgument(
                "empty UploadAdapter message: set header, chunk or trailer", "payload"
            )


def create_server(app: RegistryApp, settings: RegistrySettings) -> GrpcServer:
    """The gRPC server (bound, not started) serving ``app`` as the settings say."""
    server: GrpcServer | None = None

    def draining() -> bool:
        return server is not None and server.draining

    watches = WatchQuota(settings.max_watch_streams, settings.max_watch_streams_per_token)
    servicer = RegistryServicer(app.registry, app.authorizer, draining, watches)
    # Watches wait on threads of their own: a fleet of idle watches takes none from other RPCs.
    watch_lane = Lane(
        "watch",
        frozenset({f"/{SERVICE_NAME}/WatchAdapters"}),
        workers=settings.max_watch_streams,
        max_calls=settings.max_watch_streams,
        refusal=f"{settings.max_watch_streams} WatchAdapters streams are open on this replica, "
        "the most it serves (--max-watch-streams); retry later or on another replica",
    )
    server = GrpcServer(
        settings.server_options(settings.max_workers),
        [SERVICE_NAME],
        lambda grpc_server: registry_pb2_grpc.add_AdapterRegistryServicer_to_server(
            servicer, grpc_server
        ),
        authorizer=MethodAuthorizer(app.authorizer, METHOD_ROLES)
        if app.authorizer.enabled
        else None,
        lanes=[watch_lane],
    )
    server.on_drain(app.feed.release)  # waiting watches end with "reconnect" at once
    return server
