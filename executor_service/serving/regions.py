"""Clients' shared memory, registered with the engine: same-host requests without their bytes.

A client on the executor's host creates a POSIX shared-memory object, registers it once
(``RegisterSharedMemory``: a region name of its choosing, the object's name, a size), and then
names a Forward's input and output as (region, offset) in it; the engine reads the input and
writes the output there in place, and the RPC carries only the descriptor. Regions belong to
the caller that registered them (its token's scope): another caller cannot name them, list them
or unregister them. Every tensor's bounds are checked against the registered size. A region
unregistered while a request uses it stays mapped until that request is done.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from moelora.client.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from moelora.client.shared_memory import SHM_ROOT, Segment, valid_name

#: Regions one caller may hold at once.
MAX_REGIONS_PER_SCOPE = 64


@dataclass(frozen=True)
class RegionInfo:
    region: str
    shm_name: str
    size: int


class HeldRegion:
    def __init__(self, info: RegionInfo, segment: Segment) -> None:
        self.info = info
        self.segment = segment
        self.users = 0
        self.registered = True


class SharedRegions:
    """The engine's registered client regions, per scope (see the module doc)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._scopes: dict[str, dict[str, HeldRegion]] = {}

    def register(self, scope: str, region: str, shm_name: str, size: int) -> RegionInfo:
        if not region or len(region) > 128:
            raise InvalidArgument("region: must be 1 to 128 characters", "region")
        if not valid_name(shm_name):
            raise InvalidArgument(
                f"shm_name: {shm_name!r} is not a POSIX shared-memory name (letters, digits, "
                "'.', '_' and '-', without '/')",
                "shm_name",
            )
        info = RegionInfo(region, shm_name, size)
        with self._lock:
            held = self._scopes.setdefault(scope, {})
            known = held.get(region)
            if known is not None:
                if known.info == info:
                    return info
                raise AlreadyExists(
                    f"region: {region!r} is registered already (to {known.info.shm_name}, "
                    f"{known.info.size} bytes); unregister it first",
                    "region",
                )
            if len(held) >= MAX_REGIONS_PER_SCOPE:
                raise ResourceExhausted(
                    f"{MAX_REGIONS_PER_SCOPE} regions are registered by this caller, the most "
                    "one may hold; unregister one first",
                    "region",
                )
            segment = _open(shm_name, size)
            held[region] = HeldRegion(info, segment)
        return info

    def unregister(self, scope: str, region: str) -> None:
        with self._lock:
            found = self._scopes.get(scope, {}).pop(region, None)
            if found is None:
                raise NotFound(f"region: {region!r} is not registered by this caller", "region")
            found.registered = False
            if found.users == 0:
                found.segment.close()

    def list(self, scope: str) -> list[RegionInfo]:
        with self._lock:
            return [r.info for r in self._scopes.get(scope, {}).values()]

    def acquire(self, scope: str, region: str) -> HeldRegion:
        """Holds a region for one request (``release`` it after)."""
        with self._lock:
            found = self._scopes.get(scope, {}).get(region)
            if found is None:
                raise NotFound(
                    f"region: {region!r} is not registered by this caller (RegisterSharedMemory)",
                    "region",
                )
            found.users += 1
            return found

    def release(self, held: HeldRegion) -> None:
        with self._lock:
            held.users -= 1
            if held.users == 0 and not held.registered:
                held.segment.close()

    @staticmethod
    def view(
        held: HeldRegion, offset: int, count: int, dtype: torch.dtype, field: str
    ) -> torch.Tensor:
        """``count`` elements of ``dtype`` at ``offset`` of ``held``, bounds checked."""
        nbytes = count * dtype.itemsize
        if offset < 0 or offset + nbytes > held.info.size:
            raise InvalidArgument(
                f"{field}: bytes [{offset}, {offset + nbytes}) lie outside region "
                f"{held.info.region!r} of {held.info.size} bytes",
                field,
            )
        if offset % dtype.itemsize:
            raise InvalidArgument(
                f"{field}: offset {offset} is not a multiple of the element size", field
            )
        if count == 0:
            return torch.empty(0, dtype=dtype)
        return torch.frombuffer(held.segment.buffer, dtype=dtype, count=count, offset=offset)


def _open(shm_name: str, size: int) -> Segment:
    path = SHM_ROOT / shm_name
    try:
        actual = path.stat().st_size
    except FileNotFoundError:
        raise NotFound(
            f"shm_name: no shared-memory object {shm_name!r} on the executor's host (a client "
            "on another host cannot register its memory)",
            "shm_name",
        ) from None
    if size <= 0 or size > actual:
        raise FailedPrecondition(
            f"size: {size} bytes, but {shm_name!r} holds {actual}; register at most its size",
            "size",
        )
    try:
        return Segment(shm_name)
    except PermissionError:
        raise FailedPrecondition(
            f"shm_name: the executor may not open {shm_name!r} (its permissions)", "shm_name"
        ) from None
