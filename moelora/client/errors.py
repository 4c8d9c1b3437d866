"""Domain errors and their gRPC status codes.

Logic raises these; the gRPC layer (``error_interceptor``) turns them into a
status code and a message a person can act on. Clients turn ``grpc.RpcError``
back into the same classes with ``from_rpc_error``.
"""

from __future__ import annotations

import grpc
import grpc.aio

#: The longest message an error carries: it travels in the grpc-message trailer, whose size is
#: limited, and a request can make it quote anything (a megabyte-long name).
MAX_MESSAGE_CHARS = 1024


def quoted(text: str, limit: int = 80) -> str:
    """``repr(text)``, shortened to about ``limit`` characters: for quoting client input."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}… ({len(text)} characters)"


def capped(message: str) -> str:
    """``message`` cut to MAX_MESSAGE_CHARS, saying so."""
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    return message[: MAX_MESSAGE_CHARS - 16] + " …(truncated)"


class MoeLoraError(Exception):
    """Base of every error that has a meaning for the caller."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, field: str | None = None) -> None:
        message = capped(message)
        super().__init__(message)
        self.message = message
        self.field = field

    def __str__(self) -> str:
        return self.message


class InvalidArgument(MoeLoraError):
    """The request is malformed: bad shape, dtype, rank, name, size."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(MoeLoraError):
    """An adapter, version, alias or base model does not exist."""

    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(MoeLoraError):
    """The thing to create exists already."""

    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(MoeLoraError):
    """The request is well formed but the system is not in a state to do it
    (adapter for another base model, base model not registered, pinned adapter)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(MoeLoraError):
    """Out of slots, over a size limit."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Overloaded(ResourceExhausted):
    """Too many requests are queued: retry after ``retry_after_ms`` (sent to the client as
    the trailing metadata key ``RETRY_AFTER_METADATA``)."""

    def __init__(self, message: str, retry_after_ms: int) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


#: Trailing metadata key carrying an ``Overloaded`` error's retry hint in milliseconds.
RETRY_AFTER_METADATA = "moelora-retry-after-ms"


def retry_after_ms(error: grpc.RpcError) -> int | None:
    """The server's retry hint of a failed call, if it sent one."""
    if not isinstance(error, grpc.Call | grpc.aio.AioRpcError):
        return None
    for key, value in error.trailing_metadata() or ():
        if key == RETRY_AFTER_METADATA:
            try:
                return int(value)
            except (TypeError, ValueError):
                return None
    return None


class Unavailable(MoeLoraError):
    """Draining, not ready yet, or a dependency cannot be reached: retry later."""

    code = grpc.StatusCode.UNAVAILABLE


class Unauthenticated(MoeLoraError):
    """No valid credentials."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(MoeLoraError):
    """Valid credentials whose role does not allow the call."""

    code = grpc.StatusCode.PERMISSION_DENIED


class DataLoss(MoeLoraError):
    """Stored bytes fail their checksum."""

    code = grpc.StatusCode.DATA_LOSS


class OutOfRange(MoeLoraError):
    """A position (such as a watch sequence) is outside what is kept."""

    code = grpc.StatusCode.OUT_OF_RANGE


class Unimplemented(MoeLoraError):
    """The RPC exists in the API but this server does not do it."""

    code = grpc.StatusCode.UNIMPLEMENTED


class DeadlineExceeded(MoeLoraError):
    """The caller's deadline passed."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


_BY_CODE: dict[grpc.StatusCode, type[MoeLoraError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        AlreadyExists,
        FailedPrecondition,
        ResourceExhausted,
        Unavailable,
        Unauthenticated,
        PermissionDenied,
        DataLoss,
        OutOfRange,
        Unimplemented,
        DeadlineExceeded,
    )
}


def error_for_code(code: grpc.StatusCode, message: str) -> MoeLoraError:
    """The domain error for a status code (MoeLoraError itself for INTERNAL and others)."""
    cls = _BY_CODE.get(code)
    if cls is None:
        err = MoeLoraError(message)
        err.code = code
        return err
    return cls(message)


def from_rpc_error(error: grpc.RpcError) -> MoeLoraError:
    """Turns a failed call's ``grpc.RpcError`` back into the domain error."""
    # A failed grpc.aio call is an AioRpcError, which is not a grpc.Call but answers the same.
    call = isinstance(error, grpc.Call | grpc.aio.AioRpcError)
    code = error.code() if call else grpc.StatusCode.UNKNOWN
    details = error.details() if call else str(error)
    hint = retry_after_ms(error) if code is grpc.StatusCode.RESOURCE_EXHAUSTED else None
    if hint is not None:
        return Overloaded(details or code.name, hint)
    return error_for_code(code, details or code.name)
