"""``moelora-registry``: runs the registry gRPC server."""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from moelora.v1 import registry_pb2, registry_pb2_grpc
from registry_service.config import RegistrySettings
from shared.config import parse_settings
from shared.grpc_server import GrpcServer, ServerOptions
from shared.logs import configure_logging
from shared.metrics import start_metrics_server

SERVICE_NAME = registry_pb2.DESCRIPTOR.services_by_name["AdapterRegistry"].full_name


def main(argv: Sequence[str] | None = None) -> None:
    settings = parse_settings(RegistrySettings, argv)
    configure_logging(settings.log_level, settings.log_format)

    def register(server: grpc.Server) -> None:
        # The generated base servicer answers every RPC with UNIMPLEMENTED.
        base = registry_pb2_grpc.AdapterRegistryServicer()  # type: ignore[abstract]
        registry_pb2_grpc.add_AdapterRegistryServicer_to_server(base, server)

    server = GrpcServer(
        ServerOptions(
            listen=settings.listen,
            max_message_bytes=settings.max_message_bytes,
            drain_seconds=settings.drain_seconds,
            tls_cert_file=settings.tls_cert_file,
            tls_key_file=settings.tls_key_file,
        ),
        [SERVICE_NAME],
        register,
    )
    start_metrics_server(settings.metrics_listen)
    server.set_serving(True)
    server.serve_forever()


if __name__ == "__main__":
    main()
