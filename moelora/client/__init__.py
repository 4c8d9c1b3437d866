"""moe-lora-serve's Python client (the ``moelora-client`` distribution).

    from moelora.client import ExecutorClient

    with ExecutorClient("127.0.0.1:50052") as client:
        result = client.forward(3, hidden, segments=[(5, "sql@prod"), (3, None)])
        result.output  # hidden's kind (numpy array or torch tensor) and dtype

On the executor's host, ``client.shared_memory(...)`` gives a ring that ``forward(...,
ring=ring)`` sends its tensors through instead of the message (``moelora.client.shared_memory``).
Numpy in and out needs no torch; torch tensors (bfloat16 among them) need the ``torch`` extra,
``moelora.client.cluster`` (many executors, by layer and adapter) needs it too, and
``moelora.client.cluster.hf`` the ``transformers`` extra. Errors are the classes of
``moelora.client.errors``; the generated messages and stubs are ``moelora.v1``.
"""

from __future__ import annotations

from moelora.client.errors import (
    AlreadyExists,
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    MoeLoraError,
    NotFound,
    Overloaded,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from moelora.client.executor import ExecutorClient, ForwardCall, ForwardResult, RetryPolicy
from moelora.client.executor_aio import AsyncExecutorClient
from moelora.client.registry import RegistryClient
from moelora.client.shared_memory import SharedMemoryRing

__all__ = [
    "AlreadyExists",
    "AsyncExecutorClient",
    "DataLoss",
    "DeadlineExceeded",
    "ExecutorClient",
    "FailedPrecondition",
    "ForwardCall",
    "ForwardResult",
    "InvalidArgument",
    "MoeLoraError",
    "NotFound",
    "Overloaded",
    "PermissionDenied",
    "RegistryClient",
    "ResourceExhausted",
    "RetryPolicy",
    "SharedMemoryRing",
    "Unauthenticated",
    "Unavailable",
]
