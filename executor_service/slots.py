"""Where GPU slots are assigned, evicted, pinned and reference-counted.

Every slot holds at most one adapter version (keyed by digest). A batch *acquires* the slots of
all its adapters at once and *releases* them after its kernel: while a slot's reference count is
above zero it is never chosen for eviction, and a rewrite of the slot on the device waits for
the events recorded after the kernels that read it, so an in-flight Forward never sees its
adapter overwritten.

Eviction takes an empty slot if there is one, else the slot that the ``EvictionPolicy`` puts
first among those free of references and not pinned (``LRUPolicy``: the least recently used;
``runtime.py`` chooses the policy). Acquisition is all or nothing, so two batches never hold
part of what they need while waiting for each other:

* a batch needing more distinct adapters than there are slots not pinned by *other* adapters can
  never run: RESOURCE_EXHAUSTED at once (the caller should split it);
* a batch that could run but finds the evictable slots busy with requests in flight waits for
  releases up to its time limit, then answers RESOURCE_EXHAUSTED.

At least one slot always stays unpinned, so every single-adapter request can run.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from executor_service.packer import PackedAdapter
from executor_service.slot_buffers import DeviceEvent, SlotBuffers
from executor_service.sources import ResolvedAdapter
from moelora.client.errors import DeadlineExceeded, FailedPrecondition, NotFound, ResourceExhausted


class SlotsBusy(ResourceExhausted):
    """The slots a batch needs are held by requests in flight for longer than it may wait."""


@dataclass(frozen=True)
class Wanted:
    """An adapter a batch needs, with its packed data when the caller has it (None when it
    was in a slot as the caller looked: ``acquire`` fetches it if it has left since)."""

    adapter: ResolvedAdapter
    packed: PackedAdapter | None = None


#: Brings an adapter's packed data (host cache or source); called without the slot lock.
Fetch = Callable[[ResolvedAdapter], PackedAdapter]


class EvictionPolicy(Protocol):
    """Which occupied, evictable slot goes first. Called with the slot table's lock held."""

    def used(self, slot: int) -> None:
        """``slot`` was assigned or read by a batch."""

    def order(self, slots: Sequence[int]) -> list[int]:
        """``slots`` (occupied, evictable) in eviction order, first victim first."""


class LRUPolicy:
    """The least recently used slot goes first."""

    def __init__(self) -> None:
        self._tick = 0
        self._last: dict[int, int] = {}

    def used(self, slot: int) -> None:
        self._tick += 1
        self._last[slot] = self._tick

    def order(self, slots: Sequence[int]) -> list[int]:
        return sorted(slots, key=lambda s: self._last.get(s, 0))


@dataclass
class _Slot:
    index: int
    adapter: ResolvedAdapter | None = None
    rank: int = 0
    nbytes: int = 0
    refcount: int = 0
    pinned: bool = False
    last_used: float | None = None
    # Set once the write is issued (CPU: done); readers wait for it before using the slot.
    written: threading.Event = field(default_factory=threading.Event)
    write_error: BaseException | None = None
    # Device event marking the write complete; kernels reading the slot wait for it.
    ready: DeviceEvent = None
    # Events after kernels that read the slot; a rewrite waits for them.
    reads: list[DeviceEvent] = field(default_factory=list)


@dataclass(frozen=True)
class SlotStatus:
    """One occupied slot, as ListLoadedAdapters reports it."""

    slot: int
    adapter: ResolvedAdapter
    rank: int
    nbytes: int
    pinned: bool
    in_flight: int
    last_used: float | None


@dataclass(frozen=True)
class SlotLease:
    """Slots held for one batch until ``SlotManager.release``."""

    slots: Mapping[str, int]  # digest -> slot index
    ready: tuple[DeviceEvent, ...]
    hits: int
    loaded: tuple[ResolvedAdapter, ...]
    #: Per loaded adapter: seconds to write (on CUDA: to issue) its copy, and its bytes.
    load_seconds: tuple[float, ...]
    load_bytes: tuple[int, ...]
    evicted: tuple[ResolvedAdapter, ...]


class SlotManager:
    """The slot table of one ``SlotBuffers``."""

    def __init__(self, buffers: SlotBuffers, policy: EvictionPolicy) -> None:
        self.buffers = buffers
        self.num_slots = buffers.geometry.num_slots
        self._policy = policy
        self._slots = [_Slot(index=i) for i in range(self.num_slots)]
        self._by_digest: dict[str, _Slot] = {}
        self._cond = threading.Condition()

    # -- queries -------------------------------------------------------------------------

    def holds(self, digest: str) -> bool:
        with self._cond:
            return digest in self._by_digest

    def adapters(self) -> list[ResolvedAdapter]:
        """The adapters in slots (cheaper than ``status``)."""
        with self._cond:
            return [s.adapter for s in self._by_digest.values() if s.adapter is not None]

    def status(self) -> list[SlotStatus]:
        """Occupied slots by index."""
        with self._cond:
            return [self._status(s) for s in self._slots if s.adapter is not None]

    def free_slots(self) -> int:
        with self._cond:
            return sum(1 for s in self._slots if s.adapter is None)

    def pinned_slots(self) -> int:
        with self._cond:
            return sum(1 for s in self._slots if s.pinned)

    def pinned_digests(self) -> set[str]:
        with self._cond:
            return {s.adapter.digest for s in self._slots if s.pinned and s.adapter}

    def check_capacity(self, adapters: Sequence[ResolvedAdapter]) -> None:
        """ResourceExhausted ("split the request") if ``adapters`` can never hold slots at
        the same time."""
        with self._cond:
            self._check_capacity({a.digest: a for a in adapters})

    def fits(self, digests: Iterable[str]) -> bool:
        """Whether adapters with these digests could ever hold slots at the same time."""
        wanted = set(digests)
        with self._cond:
            return len(wanted) <= self._usable(wanted)

    # -- acquire / release ---------------------------------------------------------------

    def acquire(self, wanted: Sequence[Wanted], fetch: Fetch, timeout: float) -> SlotLease:
        """Holds a slot for each of ``wanted`` (distinct digests), loading those not resident
        into evicted slots (fetching with ``fetch`` the data ``wanted`` lacks). Raises
        ResourceExhausted as the module docstring says (``SlotsBusy`` after waiting)."""
        by_digest = {w.adapter.digest: w.adapter for w in wanted}
        data = {w.adapter.digest: w.packed for w in wanted if w.packed is not None}
        deadline = time.monotonic() + timeout
        self._cond.acquire()
        try:
            while True:
                self._check_capacity(by_digest)
                missing = [a for d, a in by_digest.items() if d not in self._by_digest]
                lacking = [a for a in missing if a.digest not in data]
                if lacking:
                    # Evicted since the caller looked: fetch without the lock, look again.
                    self._cond.release()
                    try:
                        data.update((a.digest, fetch(a)) for a in lacking)
                    finally:
                        self._cond.acquire()
                    continue
                victims = self._victims(len(missing), by_digest)
                if victims is not None:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise SlotsBusy(
                        f"all {self.num_slots} GPU adapter slots are pinned or in use by "
                        f"requests in flight (waited {timeout:.1f}s); retry, or use fewer "
                        "distinct adapters per request"
                    )
                self._cond.wait(remaining)
            hits = [self._by_digest[d] for d in by_digest if d in self._by_digest]
            evicted = tuple(v.adapter for v in victims if v.adapter is not None)
            writes = []
            for victim, adapter in zip(victims, missing, strict=True):
                writes.append((victim, data[adapter.digest], victim.reads))
                self._assign(victim, adapter, data[adapter.digest])
            held = hits + victims
            for slot in held:
                slot.refcount += 1
            slots = {digest: self._by_digest[digest].index for digest in by_digest}
        finally:
            self._cond.release()
        seconds: list[float] = []
        try:
            for victim, packed, reads in writes:
                start = time.perf_counter()
                self._write(victim, packed, reads)
                seconds.append(time.perf_counter() - start)
            for slot in hits:
                self._await_written(slot)
        except BaseException:
            self.release_slots(held, None)
            raise
        # Stable without the lock: a slot with references is never rewritten.
        return SlotLease(
            slots=slots,
            ready=tuple(s.ready for s in held),
            hits=len(hits),
            loaded=tuple(missing),
            load_seconds=tuple(seconds),
            load_bytes=tuple(packed.nbytes for _, packed, _ in writes),
            evicted=evicted,
        )

    def release(self, lease: SlotLease, done: DeviceEvent) -> None:
        """Drops the lease's references; ``done`` marks the end of the kernels that read the
        slots (None on the CPU, where they finished)."""
        with self._cond:
            held = [self._slots[i] for i in lease.slots.values()]
        self.release_slots(held, done)

    def release_slots(self, held: Iterable[_Slot], done: DeviceEvent) -> None:
        now = time.time()
        with self._cond:
            for slot in held:
                slot.refcount -= 1
                self._policy.used(slot.index)
                slot.last_used = now
                if done is not None:
                    slot.reads = [*self.buffers.sync.pending(slot.reads), done]
            self._cond.notify_all()

    # -- pin / unpin / evict -------------------------------------------------------------

    def pin(self, digest: str) -> SlotStatus:
        """Pins a resident adapter. Leaves at least one slot unpinned."""
        with self._cond:
            slot = self._resident(digest)
            if not slot.pinned:
                pinned = sum(1 for s in self._slots if s.pinned)
                if pinned + 1 >= self.num_slots:
                    raise ResourceExhausted(
                        f"cannot pin {slot.adapter.label if slot.adapter else digest}: "
                        f"{pinned} of {self.num_slots} GPU slots are pinned and one must stay "
                        "unpinned; unpin an adapter first"
                    )
                slot.pinned = True
            return self._status(slot)

    def unpin(self, digest: str) -> SlotStatus | None:
        """Unpins the adapter; None when it is not in a slot."""
        with self._cond:
            slot = self._by_digest.get(digest)
            if slot is None:
                return None
            slot.pinned = False
            self._cond.notify_all()
            return self._status(slot)

    def evict(self, digest: str, timeout: float, unpin: bool = False) -> SlotStatus | None:
        """Empties the adapter's slot once the requests using it finished (waiting up to
        ``timeout``). Refuses pinned adapters unless ``unpin``. None when it is not in a slot."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                slot = self._by_digest.get(digest)
                if slot is None:
                    return None
                if slot.pinned and unpin:
                    slot.pinned = False
                if slot.pinned:
                    label = slot.adapter.label if slot.adapter else digest
                    raise FailedPrecondition(f"adapter {label} is pinned; unpin it first")
                if slot.refcount == 0:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise DeadlineExceeded(
                        f"adapter {slot.adapter.label if slot.adapter else digest} is still "
                        f"used by {slot.refcount} requests in flight after {timeout:.1f}s"
                    )
                self._cond.wait(remaining)
            status = self._status(slot)
            del self._by_digest[digest]
            slot.adapter = None
            slot.rank = slot.nbytes = 0
            slot.last_used = None
            self._cond.notify_all()
            return status

    # -- internals (call with the lock held) ---------------------------------------------

    def _usable(self, wanted: Iterable[str]) -> int:
        """Slots not pinned by adapters other than ``wanted``."""
        keep = set(wanted)
        return self.num_slots - sum(
            1 for s in self._slots if s.pinned and s.adapter and s.adapter.digest not in keep
        )

    def _check_capacity(self, wanted: Mapping[str, ResolvedAdapter]) -> None:
        usable = self._usable(wanted)
        pinned_elsewhere = self.num_slots - usable
        if len(wanted) > usable:
            raise ResourceExhausted(
                f"the request uses {len(wanted)} distinct adapters but at most {usable} fit in "
                f"the GPU slots at once ({self.num_slots} slots, {pinned_elsewhere} pinned by "
                "other adapters); split the request"
            )

    def _victims(self, count: int, wanted: Mapping[str, ResolvedAdapter]) -> list[_Slot] | None:
        """``count`` evictable slots, empty ones first, then in the policy's order; None if
        fewer are evictable right now."""
        candidates = [
            s
            for s in self._slots
            if not s.pinned
            and s.refcount == 0
            and (s.adapter is None or s.adapter.digest not in wanted)
        ]
        if len(candidates) < count:
            return None
        empty = [s for s in candidates if s.adapter is None]
        order = self._policy.order([s.index for s in candidates if s.adapter is not None])
        return (empty + [self._slots[i] for i in order])[:count]

    def _assign(self, slot: _Slot, adapter: ResolvedAdapter, packed: PackedAdapter) -> None:
        if slot.adapter is not None:
            del self._by_digest[slot.adapter.digest]
        slot.adapter = adapter
        self._policy.used(slot.index)
        slot.last_used = None
        slot.rank = packed.rank
        slot.nbytes = packed.nbytes
        slot.written.clear()
        slot.write_error = None
        slot.ready = None
        slot.reads = []
        self._by_digest[adapter.digest] = slot

    def _resident(self, digest: str) -> _Slot:
        slot = self._by_digest.get(digest)
        if slot is None:
            raise NotFound("the adapter is not in a GPU slot")
        return slot

    def _status(self, slot: _Slot) -> SlotStatus:
        assert slot.adapter is not None
        return SlotStatus(
            slot=slot.index,
            adapter=slot.adapter,
            rank=slot.rank,
            nbytes=slot.nbytes,
            pinned=slot.pinned,
            in_flight=slot.refcount,
            last_used=slot.last_used,
        )

    # -- device writes (without the lock: other batches proceed meanwhile) ---------------

    def _write(self, slot: _Slot, packed: PackedAdapter, reads: list[DeviceEvent]) -> None:
        try:
            slot.ready = self.buffers.write(slot.index, packed, reads)
        except BaseException as exc:
            with self._cond:
                slot.write_error = exc
                if slot.adapter is not None:
                    self._by_digest.pop(slot.adapter.digest, None)
                slot.adapter = None
            slot.written.set()
            raise
        slot.written.set()

    @staticmethod
    def _await_written(slot: _Slot) -> None:
        slot.written.wait()
        if slot.write_error is not None:
            raise RuntimeError("writing the adapter into its GPU slot failed") from (
                slot.write_error
            )
