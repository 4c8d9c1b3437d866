"""Who may call the registry: each RPC's least role, checked on the call's metadata before its
request is read (``shared.call_limits``).

Reading needs ``read``; publishing, aliasing and deleting adapter versions need ``write``;
registering base models and collecting garbage need ``admin``.
"""

from __future__ import annotations

from collections.abc import Mapping

from moelora.v1 import registry_pb2
from shared.tokens import Role, method_roles

_SERVICE = registry_pb2.DESCRIPTOR.services_by_name["AdapterRegistry"]

# A new RPC is refused until it is named here (tests/registry/test_auth.py checks that every RPC
# of the proto is).
_ROLES_BY_NAME = {
    **dict.fromkeys(
        (
            "GetBaseModel", "ListBaseModels", "GetAdapter", "ListAdapters", "DownloadAdapter",
            "GetDownloadUrls", "WatchAdapters",
        ),
        Role.READ,
    ),
    **dict.fromkeys(
        ("UploadAdapter", "SetAlias", "DeleteAlias", "DeleteAdapterVersion"), Role.WRITE
    ),
    **dict.fromkeys(("RegisterBaseModel", "GarbageCollect"), Role.ADMIN),
}  # fmt: skip

#: Full method name -> the least role that may call it; an RPC missing here is refused.
METHOD_ROLES: Mapping[str, Role] = method_roles(_SERVICE, _ROLES_BY_NAME)
