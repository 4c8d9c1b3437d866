"""Server reflection under both names clients ask for: ``grpc.reflection.v1`` (grpcurl,
``buf curl --reflect-protocol grpc-v1``, gRPC-Java's tools) and the older ``v1alpha``.

grpcio-reflection serves only v1alpha (grpc/grpc#38576). v1's messages are v1alpha's, field for
field, under another package, so the same servicer answers both: v1 calls are decoded and
encoded with v1alpha's classes, and a copy of v1alpha's file descriptor renamed to v1 is added
to the pool so that v1 can describe itself too (as gRPC-Java serves both from one servicer).
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

V1_SERVICE = "grpc.reflection.v1.ServerReflection"
_V1_FILE = "grpc/reflection/v1/reflection.proto"
_V1ALPHA_PACKAGE = reflection_pb2.DESCRIPTOR.package


def _add_v1_descriptor(pool: descriptor_pool.DescriptorPool) -> None:
    """v1alpha's reflection.proto renamed to grpc.reflection.v1, unless the pool has it."""
    try:
        pool.FindFileByName(_V1_FILE)
        return
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    proto.name = _V1_FILE
    proto.package = "grpc.reflection.v1"
    old, new = f".{_V1ALPHA_PACKAGE}.", ".grpc.reflection.v1."
    for message in proto.message_type:
        for field in message.field:
            if field.HasField("type_name"):
                field.type_name = field.type_name.replace(old, new)
    for method in proto.service[0].method:
        method.input_type = method.input_type.replace(old, new)
        method.output_type = method.output_type.replace(old, new)
    pool.Add(proto)


def enable_reflection(service_names: Sequence[str], server: grpc.Server) -> None:
    """Serves reflection v1 and v1alpha for ``service_names`` (and for themselves)."""
    _add_v1_descriptor(descriptor_pool.Default())
    servicer = reflection.ReflectionServicer([*service_names, reflection.SERVICE_NAME, V1_SERVICE])
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1 = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(V1_SERVICE, {"ServerReflectionInfo": v1}),)
    )
