"""What adapter references resolved to, and how far each answer can still be trusted.

An answer is *fresh* while the registry vouches for it: the registry gave it less than
``staleness_seconds`` ago, or the change stream (``RegistryWatcher``) has been connected since
before it was given, so any move, new version or deletion would have dropped it. After the
stream ends, what it covered stays fresh for ``staleness_seconds`` more. A stale answer is asked
again before use while the registry answers; while it does not, the stale answer is what the
executor serves (``RegistrySource`` decides that, with ``RegistryOutage``).

This covers pinned references too: ``name:V`` stops resolving when the version is deleted, so
an executor that cannot watch asks again rather than serving a deleted version for ever.

Answers are seeded from the disk cache at start-up (``name:V`` and ``name@sha256:...`` from the
entries, moving references from the references it kept), never fresh, so that an executor
restarted during an outage serves what it held.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from executor_service.disk_cache import DiskCache
from executor_service.sources import ResolvedAdapter
from shared.refs import AdapterRef

#: Default of ``--registry-staleness-seconds``.
DEFAULT_STALENESS_SECONDS = 10.0


@dataclass(frozen=True)
class Resolution:
    adapter: ResolvedAdapter
    #: When (monotonic) the registry last gave this answer; -inf: not in this process.
    checked: float


@dataclass(frozen=True)
class Lookup:
    """What ``Resolutions.lookup`` found: the answer (None when never resolved), whether it
    is fresh, and the generation to hand back to ``store``."""

    resolution: Resolution | None
    fresh: bool
    generation: tuple[int, int]


class Resolutions:
    """Reference -> version answers with their age; thread-safe."""

    def __init__(
        self,
        disk: DiskCache,
        staleness_seconds: float = DEFAULT_STALENESS_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._disk = disk
        self.staleness_seconds = staleness_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[str, Resolution] = {}
        #: Bumped whenever answers may have gone stale (a fresh stream: all of them; an event
        #: or NOT_FOUND: one adapter name's), so that an answer fetched before cannot
        #: overwrite what the event said.
        self._epoch = 0
        self._name_generations: dict[str, int] = {}
        self._watching = False
        #: The change stream covers answers given since this time (inf: no stream yet) ...
        self._covered_from = math.inf
        #: ... up to now while it is connected, else up to this time.
        self._covered_until = -math.inf
        never = -math.inf
        for entry in disk.entries():
            adapter = entry.adapter
            self._entries[f"{adapter.name}:{adapter.version}"] = Resolution(adapter, never)
            self._entries[f"{adapter.name}@{adapter.digest}"] = Resolution(adapter, never)
        for ref, adapter in disk.references().items():
            self._entries[ref] = Resolution(adapter, never)

    @property
    def is_watching(self) -> bool:
        with self._lock:
            return self._watching

    def lookup(self, key: str) -> Lookup:
        with self._lock:
            found = self._entries.get(key)
            fresh = found is not None and self._fresh(found)
            return Lookup(found, fresh, self._generation(AdapterRef.parse(key).name))

    def _generation(self, name: str) -> tuple[int, int]:
        return self._epoch, self._name_generations.get(name, 0)

    def _bump(self, name: str) -> None:
        self._name_generations[name] = self._name_generations.get(name, 0) + 1

    def _fresh(self, resolution: Resolution) -> bool:
        now = self._clock()
        if now - resolution.checked < self.staleness_seconds:
            return True
        if resolution.checked < self._covered_from:
            return False
        return self._watching or now - self._covered_until < self.staleness_seconds

    def store(self, key: str, adapter: ResolvedAdapter, generation: tuple[int, int]) -> None:
        """Keeps the registry's answer for ``key``; as already stale when something changed
        its adapter since ``generation`` was looked up (the next use asks again, but an outage
        meanwhile still has it to serve)."""
        with self._lock:
            current = generation == self._generation(AdapterRef.parse(key).name)
            self._entries[key] = Resolution(adapter, self._clock() if current else -math.inf)
        if not AdapterRef.parse(key).is_pinned_version:
            self._disk.remember({key: adapter.digest})

    def drop(self, key: str) -> None:
        """The registry says ``key`` resolves to nothing (NOT_FOUND)."""
        with self._lock:
            self._entries.pop(key, None)
            self._bump(AdapterRef.parse(key).name)
        self._disk.remember({key: None})

    def changed(self, name: str, stale: Callable[[AdapterRef, ResolvedAdapter], bool]) -> None:
        """An event about adapter ``name``: drops each of its answers for which
        ``stale(ref, adapter)`` says the event changed it."""
        with self._lock:
            gone = []
            for key, resolution in self._entries.items():
                ref = AdapterRef.parse(key)
                if ref.name == name and stale(ref, resolution.adapter):
                    gone.append(key)
            for key in gone:
                del self._entries[key]
            self._bump(name)
        if gone:
            self._disk.remember(dict.fromkeys(gone))

    def watching(self, connected: bool, *, resumed: bool = True) -> None:
        """The change stream connected (``resumed``: after the last event seen, so nothing
        was missed since the previous stream) or ended."""
        with self._lock:
            now = self._clock()
            if connected and not resumed:
                self._covered_from = now  # moves before it may have been missed
                self._epoch += 1
            elif not connected and self._watching:
                self._covered_until = now
            self._watching = connected
