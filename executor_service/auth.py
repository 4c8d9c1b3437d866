"""Who may call the executor: the registry's token file and roles, checked per RPC.

Computing and looking need ``read``: Forward, ForwardStream, the listings, the info, and a
caller's own shared-memory regions.
Changing what is resident needs ``admin``: Load/Unload/Pin/Unpin decide which tenants'
adapters are evicted, so a tenant's own (read) token must not reach them. ``write`` means
"may publish adapters" on the registry and grants nothing more here than ``read``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from executor_service.config import ExecutorSettings
from moelora.client.errors import PermissionDenied
from moelora.v1 import executor_pb2
from shared.grpc_server import Authorizer
from shared.tokens import Role, TokenChecker, open_token_checker

_SERVICE = executor_pb2.DESCRIPTOR.services_by_name["Executor"]

# A new RPC is refused until it is named here (tests/executor/test_auth.py checks that
# every RPC of the proto is).
_ROLES_BY_NAME = {
    **dict.fromkeys(
        (
            "Forward",
            "ForwardStream",
            "ListLoadedAdapters",
            "GetExecutorInfo",
            "WatchResidency",
            # A caller's own shared memory, for its own Forward calls (scoped to its token).
            "RegisterSharedMemory",
            "UnregisterSharedMemory",
            "ListSharedMemory",
        ),
        Role.READ,
    ),
    **dict.fromkeys(("LoadAdapter", "UnloadAdapter", "PinAdapter", "UnpinAdapter"), Role.ADMIN),
}

#: Full method name -> the least role that may call it; an RPC missing here is refused.
METHOD_ROLES: Mapping[str, Role] = {
    f"/{_SERVICE.full_name}/{m.name}": _ROLES_BY_NAME[m.name]
    for m in _SERVICE.methods
    if m.name in _ROLES_BY_NAME
}


def method_authorizer(checker: TokenChecker, roles: Mapping[str, Role]) -> Authorizer:
    """The server hook: each call's token must carry the role ``roles`` names for its method."""

    def authorize(method: str, metadata: Sequence[tuple[str, str | bytes]]) -> None:
        role = roles.get(method)
        if role is None:
            raise PermissionDenied(f"{method} is not open to any role")
        checker.require(metadata, role)

    return authorize


def open_authorizer(settings: ExecutorSettings) -> Authorizer | None:
    """The hook as the settings ask (None: auth off); refuses auth without a token file."""
    checker = open_token_checker(
        settings.auth,
        settings.listen,
        settings.auth_tokens_file,
        local=True,
        hint="ExecutorClient(token=...)",
    )
    return method_authorizer(checker, METHOD_ROLES) if checker.enabled else None
