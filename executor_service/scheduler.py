"""The one owner of a device's launches: requests wait here and leave merged into batches.

gRPC handler threads prepare their request (decode, validate, resolve, load adapters) and
``submit`` it. Whichever handler finds no launch under way becomes the *leader*: it takes the
waiting requests for the head request's layer, up to ``max_batch_tokens`` (a longer request
goes alone) and only as many distinct adapters as fit in the slots together (a request that
does not fit alongside the others waits for the next batch), runs them as one launch, hands
every request its answer, and goes on while its own request is unanswered. Then it steps down
and hands the lead to the oldest waiting request's thread. There is no thread hand-off on the
fast path: an idle executor runs a lone request on the thread that received it. Each waiting
thread sleeps on its own event and wakes once, for its answer or the lead: with dozens of
requests waiting, a shared condition's notify-all woke every one of them per launch, and each
took the GIL from the leader.

With ``batch_window_us`` > 0, a leader that finds the device idle waits that long for company
before launching (unless the batch is full already). Beyond ``max_queued_requests`` waiting
requests, ``submit`` refuses with ``Overloaded`` and a retry hint.

Errors stay per request: if a merged batch fails (say its slots stay busy past a request's
limit), each of its requests runs again alone, so only those that fail alone fail. A sticky
device error is no request's own: the ``DeviceWatch`` records it, and that batch, every request
still waiting and every later ``submit`` fail with ``DeviceFaultError`` (UNAVAILABLE).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from executor_service.batch import Prepared, batch_key
from executor_service.device_fault import DeviceFaultError, DeviceWatch
from executor_service.engine import ForwardOutput
from executor_service.metrics import ExecutorMetrics
from moelora.client.errors import Overloaded

RunBatch = Callable[[Sequence[Prepared]], list[ForwardOutput]]
Fits = Callable[[Iterable[str]], bool]


@dataclass(frozen=True)
class SchedulerSettings:
    max_batch_tokens: int = 512
    batch_window_us: int = 0
    max_queued_requests: int = 256


class _Pending:
    __slots__ = ("done", "enqueued", "error", "lead", "request", "result", "wake")

    def __init__(self, request: Prepared) -> None:
        self.request = request
        self.enqueued = time.perf_counter()
        self.result: ForwardOutput | None = None
        self.error: BaseException | None = None
        self.done = False
        #: Set (with the scheduler's lock held) when this request's thread is to lead.
        self.lead = False
        self.wake = threading.Event()


class Scheduler:
    """Batches and launches the Forward requests of one device."""

    def __init__(
        self,
        run: RunBatch,
        fits: Fits,
        settings: SchedulerSettings,
        metrics: ExecutorMetrics,
        watch: DeviceWatch,
    ) -> None:
        self._run = run
        self._fits = fits
        self._watch = watch
        self.settings = settings
        self._metrics = metrics
        # Guards the queue and the lead; the leader alone waits on it (for a batch window).
        self._cond = threading.Condition(threading.Lock())
        self._queue: deque[_Pending] = deque()
        self._leading = False
        #: Seconds the last batch took (the retry hint's unit of work).
        self._last_batch = 0.001

    def submit(self, request: Prepared) -> ForwardOutput:
        """Runs ``request`` in some batch and returns its answer (or raises its error)."""
        self._watch.check()
        pending = _Pending(request)
        with self._cond:
            if len(self._queue) >= self.settings.max_queued_requests:
                self._metrics.overloaded.inc()
                raise Overloaded(
                    f"{len(self._queue)} Forward requests are waiting for the GPU "
                    f"(--max-queued-requests={self.settings.max_queued_requests}); retry later "
                    "or on another replica",
                    retry_after_ms=self._retry_after_ms(),
                )
            self._queue.append(pending)
            self._metrics.queued_requests.set(len(self._queue))
            if self._leading:
                self._cond.notify()  # a leader waiting out its batch window
            else:
                self._leading = pending.lead = True
        if not pending.lead:
            pending.wake.wait()
        if not pending.done:
            self._lead(pending)
        if pending.error is not None:
            raise pending.error
        assert pending.result is not None
        return pending.result

    def _retry_after_ms(self) -> int:
        batches = 1 + len(self._queue) // 8
        return max(1, round(self._last_batch * batches * 1000))

    def _lead(self, own: _Pending) -> None:
        """Launches batches until ``own`` is answered, then hands the lead on."""
        idle = True
        try:
            while not own.done:
                with self._cond:
                    batch = self._take(idle)
                idle = False
                self._launch(batch)
        finally:
            with self._cond:
                if self._queue:
                    successor = self._queue[0]
                    successor.lead = True
                    successor.wake.set()
                else:
                    self._leading = False

    def _take(self, idle: bool) -> list[_Pending]:
        """The next batch, removed from the queue (called with the lock held; the queue is
        not empty: the leader's own request is in it until answered)."""
        window = self.settings.batch_window_us / 1e6
        if idle and window > 0:
            deadline = time.monotonic() + window
            while (
                self._tokens_like(self._queue[0]) < self.settings.max_batch_tokens
                and (remaining := deadline - time.monotonic()) > 0
            ):
                self._cond.wait(remaining)
        head = self._queue[0]
        key = batch_key(head.request)
        batch = [head]
        tokens = head.request.tokens
        digests = set(head.request.digests)
        for pending in list(self._queue)[1:]:
            request = pending.request
            if batch_key(request) != key:
                continue
            if tokens + request.tokens > self.settings.max_batch_tokens:
                continue
            joined = digests | request.digests
            if len(joined) > len(digests) and not self._fits(joined):
                continue  # waits for a batch its adapters fit in
            batch.append(pending)
            tokens += request.tokens
            digests = joined
        for pending in batch:
            self._queue.remove(pending)
        self._metrics.queued_requests.set(len(self._queue))
        return batch

    def _tokens_like(self, head: _Pending) -> int:
        key = batch_key(head.request)
        return sum(p.request.tokens for p in self._queue if batch_key(p.request) == key)

    def _launch(self, batch: list[_Pending]) -> None:
        start = time.perf_counter()
        for pending in batch:
            self._metrics.queue_wait_seconds.observe(start - pending.enqueued)
            self._metrics.stage["queue"].observe(start - pending.enqueued)
        groups = [batch]
        while groups:
            group = groups.pop()
            try:
                self._watch.check()
                results = self._run([p.request for p in group])
            except BaseException as exc:
                fault = self._watch.observe(exc)
                if fault is not None:  # nobody's own error: no rerun on a lost context
                    for pending in group:
                        pending.error = DeviceFaultError(fault)
                    continue
                if len(group) > 1:  # retried alone: only who fails alone fails
                    groups.extend([p] for p in group)
                    continue
                group[0].error = exc
            else:
                for pending, result in zip(group, results, strict=True):
                    pending.result = result
        self._last_batch = time.perf_counter() - start
        for pending in batch:
            pending.done = True
            pending.wake.set()
