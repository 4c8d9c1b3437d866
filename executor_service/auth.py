"""Who may call the executor: the registry's token file and roles, checked per RPC.

Computing and looking need ``read``: Forward, ForwardStream, the listings, the info, and a
caller's own shared-memory regions.
Changing what is resident needs ``admin``: Load/Unload/Pin/Unpin decide which tenants'
adapters are evicted, so a tenant's own (read) token must not reach them. ``write`` means
"may publish adapters" on the registry and grants nothing more here than ``read``.
"""

from __future__ import annotations

from collections.abc import Mapping

from executor_service.config import ExecutorSettings
from moelora.v1 import executor_pb2
from shared.tokens import MethodAuthorizer, Role, method_roles, open_token_checker

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
            # A caller's own shared and CUDA memory, for its own Forward calls (its token's).
            "RegisterSharedMemory",
            "UnregisterSharedMemory",
            "ListSharedMemory",
            "RegisterCudaMemory",
            "UnregisterCudaMemory",
            "ListCudaMemory",
            "OpenChannel",
        ),
        Role.READ,
    ),
    **dict.fromkeys(("LoadAdapter", "UnloadAdapter", "PinAdapter", "UnpinAdapter"), Role.ADMIN),
}

#: Full method name -> the least role that may call it; an RPC missing here is refused.
METHOD_ROLES: Mapping[str, Role] = method_roles(_SERVICE, _ROLES_BY_NAME)


def open_authorizer(settings: ExecutorSettings) -> MethodAuthorizer | None:
    """The hook as the settings ask (None: auth off); refuses auth without a token file."""
    checker = open_token_checker(
        settings.auth,
        settings.listen,
        settings.auth_tokens_file,
        local=True,
        hint="ExecutorClient(token=...)",
    )
    return MethodAuthorizer(checker, METHOD_ROLES) if checker.enabled else None
