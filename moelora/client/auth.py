"""Bearer tokens on gRPC calls: what clients attach and how the header reads.

Clients (adapterctl, the executor) open channels with ``open_channel(address,
token=...)``; every call then carries ``authorization: Bearer <token>``. The
header goes on through a client interceptor rather than call credentials, so
it works on plain-text channels to a loopback or in-cluster server as well as
over TLS. The server side (which tokens exist, which roles they have) belongs
to the service that checks them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import grpc

AUTHORIZATION = "authorization"
_SCHEME = "bearer "


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """The metadata that authenticates a call with ``token``."""
    if not token or token != token.strip() or any(ord(c) < 0x21 for c in token):
        raise ValueError("a bearer token must be non-empty and printable, without spaces")
    return ((AUTHORIZATION, f"Bearer {token}"),)


def bearer_token(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The token of an ``authorization: Bearer <token>`` header; None when the
    header is missing or uses another scheme."""
    for key, value in metadata or ():
        if key.lower() != AUTHORIZATION:
            continue
        text = value.decode("latin-1") if isinstance(value, bytes) else value
        if text[: len(_SCHEME)].lower() == _SCHEME:
            token = text[len(_SCHEME) :].strip()
            return token or None
        return None
    return None


class _ClientCallDetails(grpc.ClientCallDetails):  # type: ignore[misc]
    def __init__(self, base: Any, metadata: Sequence[tuple[str, str]]) -> None:
        self.method = base.method
        self.timeout = base.timeout
        self.metadata = metadata
        self.credentials = base.credentials
        self.wait_for_ready = base.wait_for_ready
        self.compression = base.compression


class BearerTokenInterceptor(
    grpc.UnaryUnaryClientInterceptor,  # type: ignore[misc]
    grpc.UnaryStreamClientInterceptor,  # type: ignore[misc]
    grpc.StreamUnaryClientInterceptor,  # type: ignore[misc]
    grpc.StreamStreamClientInterceptor,  # type: ignore[misc]
):
    """Adds the bearer header to every call on a channel."""

    def __init__(self, token: str) -> None:
        self._metadata = bearer_metadata(token)

    def _details(self, details: Any) -> _ClientCallDetails:
        return _ClientCallDetails(details, [*(details.metadata or ()), *self._metadata])

    def intercept_unary_unary(
        self, continuation: Callable[..., Any], details: Any, request: Any
    ) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(
        self, continuation: Callable[..., Any], details: Any, request: Any
    ) -> Any:
        return continuation(self._details(details), request)

    def intercept_stream_unary(
        self, continuation: Callable[..., Any], details: Any, request_iterator: Any
    ) -> Any:
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(
        self, continuation: Callable[..., Any], details: Any, request_iterator: Any
    ) -> Any:
        return continuation(self._details(details), request_iterator)


def open_channel(
    address: str,
    *,
    token: str | None = None,
    tls: bool = False,
    root_certificates: bytes | None = None,
    options: Sequence[tuple[str, Any]] = (),
) -> grpc.Channel:
    """A channel to ``address`` that sends ``token`` (when given) on every call;
    TLS with the system roots, or ``root_certificates`` (PEM) when given."""
    if tls or root_certificates is not None:
        creds = grpc.ssl_channel_credentials(root_certificates=root_certificates)
        channel = grpc.secure_channel(address, creds, options=list(options))
    else:
        channel = grpc.insecure_channel(address, options=list(options))
    if token:
        channel = grpc.intercept_channel(channel, BearerTokenInterceptor(token))
    return channel


__all__ = [
    "AUTHORIZATION",
    "BearerTokenInterceptor",
    "bearer_metadata",
    "bearer_token",
    "open_channel",
]
