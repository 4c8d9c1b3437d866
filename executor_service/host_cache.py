"""Where packed adapters wait in host memory: a byte budget, least recently used out first.

The host cache is the tier between the adapter source (slow: a registry download, a disk
read, then packing) and the GPU slots (fast: one host→device copy). Entries are keyed by
digest. Its memory is ``memory``'s (``host_pool.py``): packs write their tensors there, and
the ranges of an evicted entry go back to it once nothing uses them any more. On a CUDA
executor that memory is page-locked (pinned), so that the copies into GPU slots run
asynchronously on the side stream.

Evicting an entry only drops the host copy: an adapter that sits in a GPU slot stays there
(the slot holds its own copy), and a host→GPU copy still in flight keeps its source from
being reused (the pool hands a range out again only after the copies enqueued before its
release).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

from executor_service.host_pool import HostPool
from executor_service.packer import PackedAdapter
from executor_service.sources import ResolvedAdapter


@dataclass(frozen=True)
class HostEntry:
    """One packed adapter in host memory."""

    adapter: ResolvedAdapter
    packed: PackedAdapter
    inserted_at: float


@dataclass(frozen=True)
class HostPut:
    """What ``HostCache.put`` did."""

    entry: HostEntry
    #: False when the adapter alone is larger than the whole budget: it was not kept.
    stored: bool
    evicted: tuple[ResolvedAdapter, ...]


class HostCache:
    """Packed adapters by digest within ``budget_bytes`` (``PackedAdapter.nbytes`` each)."""

    def __init__(self, budget_bytes: int, memory: HostPool) -> None:
        self.budget_bytes = budget_bytes
        self.memory = memory
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, HostEntry] = OrderedDict()
        self._used = 0

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return self._used

    def get(self, digest: str) -> HostEntry | None:
        """The entry, now the most recently used; None on a miss."""
        with self._lock:
            entry = self._entries.get(digest)
            if entry is not None:
                self._entries.move_to_end(digest)
            return entry

    def peek(self, digest: str) -> HostEntry | None:
        """The entry without touching its recency."""
        with self._lock:
            return self._entries.get(digest)

    def put(self, adapter: ResolvedAdapter, packed: PackedAdapter) -> HostPut:
        """Inserts, evicting least recently used entries until it fits. An adapter larger
        than the budget is returned but not kept."""
        entry = HostEntry(adapter=adapter, packed=packed, inserted_at=time.time())
        if packed.nbytes > self.budget_bytes:
            return HostPut(entry=entry, stored=False, evicted=())
        evicted: list[ResolvedAdapter] = []
        with self._lock:
            previous = self._entries.pop(adapter.digest, None)
            if previous is not None:
                self._used -= previous.packed.nbytes
            while self._used + packed.nbytes > self.budget_bytes:
                _, oldest = self._entries.popitem(last=False)
                self._used -= oldest.packed.nbytes
                evicted.append(oldest.adapter)
            self._entries[adapter.digest] = entry
            self._used += packed.nbytes
        return HostPut(entry=entry, stored=True, evicted=tuple(evicted))

    def remove(self, digest: str) -> HostEntry | None:
        """Drops the entry; returns it, or None when it was not held."""
        with self._lock:
            entry = self._entries.pop(digest, None)
            if entry is not None:
                self._used -= entry.packed.nbytes
            return entry

    def entries(self) -> list[HostEntry]:
        """Every entry, least recently used first."""
        with self._lock:
            return list(self._entries.values())
