"""Where adapters are resolved and moved between tiers: source → host cache → GPU slot.

``AdapterManager`` is what the engine and the admin RPCs talk to. It resolves references to
immutable versions (keyed by digest), brings missing adapters into the host cache — fetching
and packing each digest once even when many requests ask for it at the same moment
(single-flight) — acquires GPU slots for a batch, and keeps the metrics of both tiers.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from enum import Enum

import torch

from executor_service.host_cache import HostCache, HostEntry
from executor_service.loader import Loader
from executor_service.metrics import ExecutorMetrics
from executor_service.packer import PackedAdapter, pack_adapter
from executor_service.slots import SlotLease, SlotManager, SlotStatus, Wanted
from executor_service.sources import AdapterSource, ResolvedAdapter
from kernels import LoRASlots
from moelora.client.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from moelora.client.logs import log_event
from moelora.client.model_spec import ModelSpec
from shared.refs import AdapterRef

log = logging.getLogger(__name__)


class Location(Enum):
    """Where an adapter version lives; the values are the metrics' ``tier`` labels."""

    GPU = "gpu"
    HOST = "host"
    #: Downloaded to the local disk cache, not packed in memory.
    DISK = "disk"
    #: Loaded and already evicted again by other traffic before the answer was built.
    NONE = "none"


GPU = Location.GPU.value
HOST = Location.HOST.value


@dataclass(frozen=True)
class AdapterStatus:
    """Where one adapter version lives, as ListLoadedAdapters reports it."""

    adapter: ResolvedAdapter
    location: Location
    slot: int | None
    pinned: bool
    rank: int
    nbytes: int
    in_flight: int
    last_used: float | None


@dataclass(frozen=True)
class AdapterStats:
    """The two tiers' occupancy, as ListLoadedAdapters and GetExecutorInfo report it."""

    num_slots: int
    free_slots: int
    pinned_slots: int
    slot_memory_bytes: int
    host_cache_used_bytes: int
    host_cache_budget_bytes: int


@dataclass(frozen=True)
class PackSettings:
    """What adapters are packed for: the base model, the slots' rank, the compute dtype, and
    where: the executor's device (on CUDA the packing runs on the GPU)."""

    spec: ModelSpec
    base_model_name: str
    max_rank: int
    dtype: torch.dtype
    #: Where the packing runs: the executor's device.
    device: torch.device
    #: MoE layers this executor serves: only those are packed (None: all).
    layers: frozenset[int] | None = None
    #: A CUDA pack copies files from the page cache (page_cache_dma.py) where it can.
    page_cache_dma: bool = False


@dataclass(frozen=True)
class HeldAdapters:
    """Adapters ``AdapterManager.hold`` keeps in GPU slots, in the order asked."""

    adapters: tuple[ResolvedAdapter, ...]
    lease: SlotLease

    @property
    def digests(self) -> frozenset[str]:
        return frozenset(a.digest for a in self.adapters)


class AdapterManager:
    """Resolves, loads, pins and evicts adapters for one executor."""

    def __init__(
        self,
        source: AdapterSource | None,
        pack: PackSettings,
        host: HostCache,
        slots: SlotManager,
        metrics: ExecutorMetrics,
        loader: Loader,
    ) -> None:
        self.source = source
        self._loader = loader
        self._pack = pack
        self.host = host
        self.slots = slots
        self._metrics = metrics
        self._lock = threading.Lock()
        self._loading: dict[str, Future[PackedAdapter]] = {}
        self._update_slot_gauges()

    # -- references ----------------------------------------------------------------------

    def resolve(self, ref: AdapterRef) -> ResolvedAdapter:
        """The version ``ref`` names now, as the source says: even a version the executor
        holds may have been deleted since, and only the source knows how fresh its answer is
        (the registry source answers from memory while that is fresh enough)."""
        return self._usable(self._source(ref).resolve(ref))

    def resolve_at_once(self, ref: AdapterRef) -> ResolvedAdapter | None:
        """``resolve``'s answer if the source has it without waiting, else None."""
        adapter = self._source(ref).resolve_at_once(ref)
        return None if adapter is None else self._usable(adapter)

    def _source(self, ref: AdapterRef) -> AdapterSource:
        if self.source is None:
            raise NotFound(
                f"adapter {ref} not found: the executor has no adapter source (set --adapter-dir)"
            )
        return self.source

    def _usable(self, adapter: ResolvedAdapter) -> ResolvedAdapter:
        """``adapter`` if this executor can serve it (its base model, its rank)."""
        fingerprint = adapter.base_model_fingerprint
        if fingerprint is not None and fingerprint != self._pack.spec.fingerprint:
            raise FailedPrecondition(
                f"adapter {adapter.label} was made for base model {fingerprint}, but this "
                f"executor serves {self._pack.base_model_name} ({self._pack.spec.fingerprint})"
            )
        if adapter.rank is not None and adapter.rank > self._pack.max_rank:
            log_event(
                log,
                "adapter_refused",
                logging.WARNING,
                adapter=adapter.label,
                rank=adapter.rank,
                max_rank=self._pack.max_rank,
            )
            raise FailedPrecondition(
                f"adapter {adapter.label} has rank {adapter.rank}, above this executor's "
                f"--max-rank {self._pack.max_rank}: serve it from executors started with "
                f"--max-rank {adapter.rank} or more"
            )
        return adapter

    # -- Forward's path ------------------------------------------------------------------

    def prepare(self, adapters: Sequence[ResolvedAdapter]) -> list[Wanted]:
        """What ``lease`` needs for ``adapters`` (distinct digests): the packed data of those
        not in a slot now, fetched and packed here (so that a load failure belongs to the
        request that asked). ResourceExhausted if they can never fit in the slots together."""
        self.slots.check_capacity(adapters)
        return [
            Wanted(a, None if self.slots.holds(a.digest) else self._packed(a)) for a in adapters
        ]

    def prepare_at_once(self, adapters: Sequence[ResolvedAdapter]) -> list[Wanted] | None:
        """``prepare``'s answer if every adapter is in a slot or the host cache (nothing to
        fetch or pack), else None."""
        self.slots.check_capacity(adapters)
        wanted = []
        for adapter in adapters:
            held = self.slots.holds(adapter.digest)
            packed = None if held else self._cached(adapter)
            if not held and packed is None:
                return None
            wanted.append(Wanted(adapter, packed))
        return wanted

    def can_lease(self, digests: Iterable[str]) -> bool:
        """Whether adapters with these digests fit in the slots at the same time."""
        return self.slots.fits(digests)

    @contextlib.contextmanager
    def lease(self, wanted: Sequence[Wanted], timeout: float) -> Iterator[SlotLease]:
        """Holds GPU slots for ``wanted`` while the block runs (waiting up to ``timeout`` for
        slots that requests in flight hold). Inside, the current stream already waits for
        the slots' writes; kernels enqueued inside may read them. On leaving, an event after
        those kernels keeps any rewrite of the slots behind them."""
        lease = self.slots.acquire(wanted, self._packed, timeout)
        self._count_gpu(lease)
        sync = self.slots.buffers.sync
        try:
            sync.wait(lease.ready)
            yield lease
        finally:
            self.slots.release(lease, sync.record())

    def hold(self, refs: Sequence[AdapterRef], timeout: float) -> HeldAdapters:
        """Brings ``refs``' adapters into GPU slots and keeps them there (as a request in
        flight would: never evicted) until ``release``: a direct channel's lease."""
        adapters = [self.resolve(ref) for ref in refs]
        distinct = list({a.digest: a for a in adapters}.values())
        lease = self.slots.acquire(self.prepare(distinct), self._packed, timeout)
        self._count_gpu(lease)
        return HeldAdapters(tuple(adapters), lease)

    def release(self, held: HeldAdapters) -> None:
        """Ends a ``hold`` (kernels enqueued before this may still read the slots)."""
        self.slots.release(held.lease, self.slots.buffers.sync.record())

    def lora_slots(self, layer: int) -> LoRASlots:
        """The slot buffers of one MoE layer, as the kernels read them."""
        return self.slots.buffers.layer(layer)

    def stats(self) -> AdapterStats:
        return AdapterStats(
            num_slots=self.slots.num_slots,
            free_slots=self.slots.free_slots(),
            pinned_slots=self.slots.pinned_slots(),
            slot_memory_bytes=self.slots.buffers.nbytes,
            host_cache_used_bytes=self.host.used_bytes,
            host_cache_budget_bytes=self.host.budget_bytes,
        )

    # -- admin ---------------------------------------------------------------------------

    def load(self, ref: AdapterRef, to_gpu: bool, timeout: float) -> AdapterStatus:
        """Brings the adapter into the host cache and, if ``to_gpu``, into a slot."""
        adapter = self.resolve(ref)
        if to_gpu:
            with self.lease(self.prepare([adapter]), timeout):
                status = self.status_of(adapter)
            # Taken while this call held the slot: do not count that hold.
            return replace(status, in_flight=status.in_flight - 1)
        known = self._find(adapter)
        if known is not None:
            return known
        packed = self._packed(adapter)
        if packed.nbytes > self.host.budget_bytes:
            raise ResourceExhausted(
                f"adapter {adapter.label} packs to {packed.nbytes} bytes, more than the host "
                f"cache's budget of {self.host.budget_bytes} bytes; load it with to_gpu"
            )
        return self._find(adapter) or AdapterStatus(
            adapter=adapter,
            location=Location.NONE,
            slot=None,
            pinned=False,
            rank=packed.rank,
            nbytes=packed.nbytes,
            in_flight=0,
            last_used=None,
        )

    def prefetch(self, adapter: ResolvedAdapter) -> bool:
        """Brings the adapter into the host cache unless a slot or the host cache holds it
        already (False then). Never touches the slots; shares a load in flight for the digest."""
        if self.slots.holds(adapter.digest) or self.host.peek(adapter.digest) is not None:
            return False
        self._packed(adapter)
        return True

    def pin(self, ref: AdapterRef, timeout: float) -> AdapterStatus:
        """Loads the adapter into a slot and pins it there."""
        adapter = self.resolve(ref)
        with self.lease(self.prepare([adapter]), timeout):
            slot = self.slots.pin(adapter.digest)
        self._update_slot_gauges()
        log_event(log, "adapter_pinned", adapter=adapter.label, slot=slot.slot)
        # Taken while this call held the slot: do not count that hold.
        return replace(self._from_slot(slot), in_flight=slot.in_flight - 1)

    def unpin(self, ref: AdapterRef) -> AdapterStatus:
        adapter = self._held_version(ref)
        slot = self.slots.unpin(adapter.digest)
        if slot is None:
            return self.status_of(adapter)
        self._update_slot_gauges()
        log_event(log, "adapter_unpinned", adapter=adapter.label)
        return self._from_slot(slot)

    def unload(self, ref: AdapterRef, timeout: float) -> AdapterStatus:
        """Drops the adapter from its slot (after the requests using it) and the host cache."""
        adapter = self._held_version(ref)
        slot = self.slots.evict(adapter.digest, timeout)
        if slot is not None:
            self._metrics.set_resident(adapter.label, GPU, False)
        entry = self.host.remove(adapter.digest)
        if entry is not None:
            self._metrics.set_resident(adapter.label, HOST, False)
            self._metrics.host_cache_used_bytes.set(self.host.used_bytes)
        self._update_slot_gauges()
        log_event(log, "adapter_unloaded", adapter=adapter.label)
        if slot is not None:
            return self._from_slot(slot)
        if entry is not None:
            return self._from_host(entry)
        raise NotFound(f"adapter {adapter.label} is not loaded")  # evicted meanwhile

    def free_slot(self, ref: AdapterRef, timeout: float) -> AdapterStatus:
        """Frees the adapter's GPU slot (after the requests using it); its packed copy stays
        in the host cache, so the next use is one host→device copy per layer."""
        adapter = self._held_version(ref)
        if self.slots.evict(adapter.digest, timeout) is not None:
            self._metrics.set_resident(adapter.label, GPU, False)
            self._update_slot_gauges()
        return self.status_of(adapter)

    def forget(self, digest: str, timeout: float = 30.0) -> None:
        """Drops a version its source deleted from both tiers, pinned or not, once the
        requests using it finished (waiting up to ``timeout``)."""
        try:
            slot = self.slots.evict(digest, timeout, unpin=True)
        except DeadlineExceeded as exc:
            log_event(log, "deleted_adapter_still_in_use", logging.WARNING, error=exc.message)
            return
        entry = self.host.remove(digest)
        dropped = [
            (gone.adapter.label, tier)
            for gone, tier in ((slot, GPU), (entry, HOST))
            if gone is not None
        ]
        for label, tier in dropped:
            self._metrics.set_resident(label, tier, False)
        self._metrics.host_cache_used_bytes.set(self.host.used_bytes)
        self._update_slot_gauges()
        if dropped:
            log_event(
                log,
                "deleted_adapter_dropped",
                adapter=dropped[0][0],
                digest=digest,
                tiers=[tier for _, tier in dropped],
            )

    def close(self) -> None:
        """Stops the loader's threads (a load in progress finishes) and closes the source."""
        self._loader.close()
        if self.source is not None:
            self.source.close()

    def list_loaded(self) -> list[AdapterStatus]:
        """GPU slots first (by slot), then the host cache (most recently used first), then
        the source's disk cache."""
        on_gpu = [self._from_slot(s) for s in self.slots.status()]
        held = {s.adapter.digest for s in on_gpu}
        on_host = [
            self._from_host(e)
            for e in reversed(self.host.entries())
            if e.adapter.digest not in held
        ]
        held |= {s.adapter.digest for s in on_host}
        on_disk = [
            AdapterStatus(adapter, Location.DISK, None, False, 0, 0, 0, None)
            for adapter in (self.source.cached() if self.source is not None else [])
            if adapter.digest not in held
        ]
        return on_gpu + on_host + on_disk

    def status_of(self, adapter: ResolvedAdapter) -> AdapterStatus:
        status = self._find(adapter)
        if status is None:
            raise NotFound(f"adapter {adapter.label} is not loaded")
        return status

    # -- internals -----------------------------------------------------------------------

    def _find(self, adapter: ResolvedAdapter) -> AdapterStatus | None:
        for status in self.list_loaded():
            if status.adapter.digest == adapter.digest:
                return status
        return None

    def _held(self) -> list[ResolvedAdapter]:
        return self.slots.adapters() + [e.adapter for e in self.host.entries()]

    def _held_version(self, ref: AdapterRef) -> ResolvedAdapter:
        """The held version ``ref`` names (resolved as everywhere), or NotFound."""
        adapter = self.resolve(ref)
        held = [a for a in self._held() if a.name == adapter.name]
        if adapter.digest not in {a.digest for a in held}:
            loaded = ", ".join(a.label for a in held) or "none"
            raise NotFound(
                f"adapter {ref} resolves to {adapter.label}, which is not loaded "
                f"(loaded versions of {adapter.name}: {loaded})"
            )
        return adapter

    def _cached(self, adapter: ResolvedAdapter) -> PackedAdapter | None:
        """The packed adapter if the host cache holds it (counted as a hit)."""
        entry = self.host.get(adapter.digest)
        if entry is None:
            return None
        self._metrics.cache_hits.labels(HOST).inc()
        return entry.packed

    def _packed(self, adapter: ResolvedAdapter) -> PackedAdapter:
        """The packed adapter from the host cache, else fetched and packed once per digest
        however many callers ask at the same time."""
        cached = self._cached(adapter)
        if cached is not None:
            return cached
        with self._lock:
            future = self._loading.get(adapter.digest)
            leader = future is None
            if future is None:
                future = Future()
                self._loading[adapter.digest] = future
        if not leader:
            return future.result()
        try:
            entry = self._fetch_and_pack(adapter)
            future.set_result(entry.packed)
            return entry.packed
        except BaseException as exc:
            future.set_exception(exc)
            raise
        finally:
            with self._lock:
                del self._loading[adapter.digest]

    def _fetch_and_pack(self, adapter: ResolvedAdapter) -> HostEntry:
        self._metrics.cache_misses.labels(HOST).inc()
        if self.source is None:  # resolve() found it held; it has been evicted since
            raise NotFound(f"adapter {adapter.label} was evicted and there is no adapter source")
        start = time.perf_counter()
        files = self.source.fetch(adapter)
        pack = self._pack
        try:
            try:
                packed = self._loader.run(
                    lambda: pack_adapter(
                        files.config,
                        files.weights,
                        pack.spec,
                        pack.max_rank,
                        pack.dtype,
                        pack.layers,
                        device=pack.device,
                        page_cache_dma=pack.page_cache_dma,
                        memory=self.host.memory,
                    )
                )
            except InvalidArgument as exc:
                files.finish()  # damaged in transit: that (DataLoss) is the error to report
                # The request was fine; the stored adapter does not fit this executor.
                raise FailedPrecondition(
                    f"adapter {adapter.label} cannot be used with base model "
                    f"{pack.base_model_name}: {exc.message}"
                ) from None
            # Packed from bytes as they arrived: published only once they proved genuine.
            files.finish()
        finally:
            files.close()
        put = self.host.put(adapter, packed)
        seconds = time.perf_counter() - start
        self._metrics.load_seconds.labels(HOST).observe(seconds)
        self._metrics.load_bytes.labels(HOST).inc(packed.nbytes)
        if put.stored:
            self._metrics.set_resident(adapter.label, HOST, True)
        for gone in put.evicted:
            self._metrics.evictions.labels(HOST).inc()
            self._metrics.set_resident(gone.label, HOST, False)
        self._metrics.host_cache_used_bytes.set(self.host.used_bytes)
        log_event(
            log,
            "adapter_packed",
            adapter=adapter.label,
            digest=adapter.digest,
            rank=packed.rank,
            bytes=packed.nbytes,
            cached=put.stored,
            evicted=[a.label for a in put.evicted],
            seconds=round(seconds, 5),
        )
        return put.entry

    def _count_gpu(self, lease: SlotLease) -> None:
        metrics = self._metrics
        metrics.cache_hits.labels(GPU).inc(lease.hits)
        if not lease.loaded:
            return
        metrics.cache_misses.labels(GPU).inc(len(lease.loaded))
        metrics.evictions.labels(GPU).inc(len(lease.evicted))
        for gone in lease.evicted:
            metrics.set_resident(gone.label, GPU, False)
        for adapter, seconds, nbytes in zip(
            lease.loaded, lease.load_seconds, lease.load_bytes, strict=True
        ):
            metrics.set_resident(adapter.label, GPU, True)
            metrics.load_seconds.labels(GPU).observe(seconds)
            metrics.load_bytes.labels(GPU).inc(nbytes)
        self._update_slot_gauges()
        log_event(
            log,
            "adapters_to_slots",
            loaded=[a.label for a in lease.loaded],
            slots=[lease.slots[a.digest] for a in lease.loaded],
            evicted=[a.label for a in lease.evicted],
        )

    def _update_slot_gauges(self) -> None:
        free = self.slots.free_slots()
        pinned = self.slots.pinned_slots()
        gauge = self._metrics.gpu_slots
        gauge.labels("free").set(free)
        gauge.labels("pinned").set(pinned)
        gauge.labels("loaded").set(self.slots.num_slots - free - pinned)
        running = [adapter.label for adapter in self.slots.adapters()]
        self._metrics.set_lora_info(running, self.slots.num_slots)

    @staticmethod
    def _from_slot(status: SlotStatus) -> AdapterStatus:
        return AdapterStatus(
            adapter=status.adapter,
            location=Location.GPU,
            slot=status.slot,
            pinned=status.pinned,
            rank=status.rank,
            nbytes=status.nbytes,
            in_flight=status.in_flight,
            last_used=status.last_used,
        )

    @staticmethod
    def _from_host(entry: HostEntry) -> AdapterStatus:
        return AdapterStatus(
            adapter=entry.adapter,
            location=Location.HOST,
            slot=None,
            pinned=False,
            rank=entry.packed.rank,
            nbytes=entry.packed.nbytes,
            in_flight=0,
            last_used=None,
        )
