"""Background prefetch of adapters the registry just aliased (``--prefetch-on-watch``).

An alias set or moved (``prod`` promoted to a new version) is a strong hint that requests for
that version are coming. ``Prefetcher`` takes those events from ``RegistryWatcher`` and brings
the version into the host cache (packed, not into a GPU slot, so a serving adapter's slot is
never evicted for a guess) on ``max_inflight`` worker threads. Loads go through
``AdapterManager.prefetch``, so a prefetch and a request for the same digest share one
fetch-and-pack.

The queue is bounded: when it is full the oldest waiting event is dropped (newer promotions
matter more) and counted. A failed prefetch is logged and not retried; the adapter still loads
on first use. Stream errors never reach here: the watcher reconnects with backoff and resumes
after the last sequence it saw, so no alias event is missed.
"""

from __future__ import annotations

import collections
import logging
import threading
import time

from executor_service.adapters import AdapterManager
from executor_service.device_fault import DeviceWatch
from executor_service.metrics import ExecutorMetrics
from moelora.client.errors import MoeLoraError
from moelora.client.logs import log_event
from moelora.v1 import registry_pb2
from shared.refs import AdapterRef

log = logging.getLogger(__name__)

#: Waiting prefetches per worker before the oldest is dropped.
QUEUE_PER_WORKER = 8


class Prefetcher:
    """Loads newly aliased versions into the host cache in the background (see the module doc)."""

    def __init__(
        self,
        manager: AdapterManager,
        metrics: ExecutorMetrics,
        max_inflight: int,
        watch: DeviceWatch,
    ) -> None:
        self._manager = manager
        self._watch = watch
        self._metrics = metrics
        self._queue: collections.deque[AdapterRef] = collections.deque()
        self._capacity = QUEUE_PER_WORKER * max_inflight
        self._changed = threading.Condition()
        self._stopping = False
        self._workers = [
            threading.Thread(target=self._work, name=f"prefetch-{i}", daemon=True)
            for i in range(max_inflight)
        ]

    def start(self) -> None:
        for worker in self._workers:
            worker.start()

    def offer(self, event: registry_pb2.WatchAdaptersResponse) -> None:
        """Queues the version an ALIAS_SET event points at; other events are ignored. Never
        blocks (the watcher's thread calls it)."""
        if event.type != registry_pb2.AdapterEventType.ADAPTER_EVENT_TYPE_ALIAS_SET:
            return
        # By digest: the alias may move again before the worker gets to it.
        ref = AdapterRef(event.name, digest=event.digest)
        with self._changed:
            if self._stopping or ref in self._queue:
                return
            if len(self._queue) >= self._capacity:
                dropped = self._queue.popleft()
                self._metrics.prefetches.labels("dropped").inc()
                log_event(log, "prefetch_dropped", logging.WARNING, adapter=str(dropped))
            self._queue.append(ref)
            self._changed.notify()

    def close(self, timeout: float = 5.0) -> None:
        """Drops what waits and stops the workers; a load in progress finishes first (up to
        ``timeout`` for all of them)."""
        with self._changed:
            self._stopping = True
            self._queue.clear()
            self._changed.notify_all()
        deadline = time.monotonic() + timeout
        for worker in self._workers:
            if worker.is_alive():
                worker.join(max(0.0, deadline - time.monotonic()))
        if any(worker.is_alive() for worker in self._workers):
            log_event(log, "prefetch_still_loading_at_close", logging.WARNING)

    def _work(self) -> None:
        while True:
            with self._changed:
                while not self._queue and not self._stopping:
                    self._changed.wait()
                if self._stopping:
                    return
                ref = self._queue.popleft()
            self._prefetch(ref)

    def _prefetch(self, ref: AdapterRef) -> None:
        start = time.perf_counter()
        try:
            adapter = self._manager.resolve(ref)
            loaded = self._manager.prefetch(adapter)
        except MoeLoraError as exc:
            self._metrics.prefetches.labels("failed").inc()
            log_event(log, "prefetch_failed", logging.WARNING, adapter=str(ref), error=exc.message)
            return
        except Exception as exc:  # a pack on the GPU may be the first to meet a lost device
            if self._watch.observe(exc) is None:
                raise
            return
        result = "loaded" if loaded else "held"
        self._metrics.prefetches.labels(result).inc()
        log_event(
            log,
            "adapter_prefetched",
            adapter=adapter.label,
            digest=adapter.digest,
            result=result,
            seconds=round(time.perf_counter() - start, 4),
        )
