"""The one owner of a device's launches: requests wait here and leave merged into batches.

Whoever prepared a request (decoded, validated, resolved, adapters at hand) ``submit``s it with
a callback and goes on: nothing waits on a thread per request. One loop thread, the only one
that launches on the device, takes the waiting requests for the head request's layer, up to
``max_batch_tokens`` (a longer request goes alone) and only as many distinct adapters as fit in
the slots together (a request that does not fit alongside the others waits for the next
batch), runs them as one launch, and calls each request's callback with its answer. With
dozens of requests in flight the engine thus holds a handful of threads, not one per request:
a thread per waiting request once had every one of them fight the launching thread for the
GIL after each device call.

With ``batch_window_us`` > 0, the loop that finds the device idle waits that long for company
before launching (unless the batch is full already). Beyond ``max_queued_requests`` waiting
requests, ``submit`` refuses with ``Overloaded`` and a retry hint.

Errors stay per request: if a merged batch fails (say its slots stay busy past a request's
limit), each of its requests runs again alone, so only those that fail alone fail. A sticky
device error is no request's own: the ``DeviceWatch`` records it, and that batch, every request
still waiting and every later ``submit`` fail with ``DeviceFaultError`` (UNAVAILABLE).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from executor_service.batch import Prepared, batch_key
from executor_service.device_fault import DeviceFaultError, DeviceWatch
from executor_service.engine import ForwardOutput
from executor_service.metrics import ExecutorMetrics
from moelora.client.errors import Overloaded, Unavailable
from moelora.client.logs import log_event

#: Runs a batch as one launch; the callable, if any, is work to do while the device computes.
RunBatch = Callable[[Sequence[Prepared], Callable[[], None] | None], list[ForwardOutput]]
Fits = Callable[[Iterable[str]], bool]
#: Called once per request on the loop thread with its answer or its error; it must be quick
#: (the next launch waits for it) and raise nothing.
Done = Callable[[ForwardOutput | None, BaseException | None], None]
#: Called once on the loop thread after the answers of a launch that used it (say, to send a
#: front end its answers in one write); it must be quick and raise nothing.
Flush = Callable[[], None]


class IdlePoller(Protocol):
    """Where else requests arrive than ``post`` and ``submit``: shared memory the loop polls
    (``executor_service.serving.spin_poller``)."""

    @property
    def sleep_timeout(self) -> float | None: ...

    def poll(self) -> bool: ...

    def idle(self, work_waiting: Callable[[], bool]) -> bool: ...

    def take_busy(self) -> float: ...


log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SchedulerSettings:
    max_batch_tokens: int = 512
    batch_window_us: int = 0
    max_queued_requests: int = 256
    #: Run posted tasks (preparing new arrivals) while the device computes a launch.
    prepare_during_launch: bool = True


class _Pending:
    __slots__ = ("done", "enqueued", "flush", "request")

    def __init__(self, request: Prepared, done: Done, flush: Flush | None) -> None:
        self.request = request
        self.done = done
        self.flush = flush
        self.enqueued = time.perf_counter()


class Scheduler:
    """Batches and launches the Forward requests of one device on its own thread."""

    def __init__(
        self,
        run: RunBatch,
        fits: Fits,
        settings: SchedulerSettings,
        metrics: ExecutorMetrics,
        watch: DeviceWatch,
        on_start: Callable[[], object] | None = None,
    ) -> None:
        self._run = run
        self._on_start = on_start
        self._fits = fits
        self._watch = watch
        self.settings = settings
        self._metrics = metrics
        self._cond = threading.Condition(threading.Lock())
        self._queue: deque[_Pending] = deque()
        self._tasks: list[Callable[[], None]] = []
        self._closed = False
        self._poller: IdlePoller | None = None
        self._polled = False  # the last launch polled while its device computed
        #: Seconds the last batch took (the retry hint's unit of work).
        self._last_batch = 0.001
        #: When the loop last stopped waiting (see ``_wait``).
        self._busy_since = time.perf_counter()
        self._thread = threading.Thread(target=self._loop, name="launch-loop", daemon=True)
        self._thread.start()

    def submit(self, request: Prepared, done: Done, flush: Flush | None = None) -> None:
        """Queues ``request``; ``done`` gets its answer from the loop thread, and ``flush``
        runs once after all the answers of its launch. Raises (and never calls either) if the
        request cannot wait: Overloaded, or the device's fault."""
        self._watch.check()
        with self._cond:
            if self._closed:
                raise Unavailable("the executor is stopping; retry on another replica")
            if len(self._queue) >= self.settings.max_queued_requests:
                self._metrics.overloaded.inc()
                raise Overloaded(
                    f"{len(self._queue)} Forward requests are waiting for the GPU "
                    f"(--max-queued-requests={self.settings.max_queued_requests}); retry later "
                    "or on another replica",
                    retry_after_ms=self._retry_after_ms(),
                )
            self._queue.append(_Pending(request, done, flush))
            self._metrics.queued_requests.set(len(self._queue))
            self._cond.notify()

    def close(self) -> None:
        """Stops the loop after its launch under way; requests still waiting fail UNAVAILABLE."""
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _retry_after_ms(self) -> int:
        batches = 1 + len(self._queue) // 8
        return max(1, round(self._last_batch * batches * 1000))

    def poll_while_idle(self, poller: IdlePoller) -> None:
        """Has the loop poll ``poller`` when it has nothing to do, between launches and
        while the device computes (where it prepares posted tasks)."""
        with self._cond:
            self._poller = poller
            self._cond.notify()

    def post(self, task: Callable[[], None]) -> None:
        """Runs ``task`` on the loop thread between launches (the engine prepares requests
        there: one thread, no fight for the GIL). It must be quick and raise nothing."""
        with self._cond:
            if self._closed:
                raise Unavailable("the executor is stopping; retry on another replica")
            self._tasks.append(task)
            self._cond.notify()

    def _loop(self) -> None:
        stopping = Unavailable("the executor is stopping; retry on another replica")
        window = self.settings.batch_window_us / 1e6
        idle = True  # the device has nothing to do: a batch window may wait for company
        deadline: float | None = None
        try:
            if self._on_start is not None:
                self._on_start()
            while True:
                with self._cond:
                    if not self._queue:
                        idle = True
                    while not self._work_waiting():
                        if self._poll_idle():
                            continue
                        poller = self._poller
                        self._wait(None if poller is None else poller.sleep_timeout)
                    if self._closed:
                        break
                # Between launches too where the last launch did not poll (the CPU computes on
                # this thread): a loop that never runs dry would otherwise starve polled clients.
                if not self._polled:
                    self._poll_once()
                self._polled = False
                self._run_posted()
                with self._cond:
                    if not self._queue:
                        continue
                    if idle and window > 0:
                        deadline = deadline or time.monotonic() + window
                        remaining = deadline - time.monotonic()
                        full = self._tokens_like(self._queue[0]) >= self.settings.max_batch_tokens
                        if remaining > 0 and not full:
                            if not self._tasks:
                                self._wait(remaining)
                            continue
                    batch = self._take()
                    deadline, idle = None, False
                self._launch(batch)
        except BaseException:
            log_event(log, "launch_loop_failed", logging.CRITICAL, exc_info=True)
            stopping = Unavailable("the executor's launch loop failed; retry on another replica")
        self._metrics.launch_loop_busy.inc(time.perf_counter() - self._busy_since)
        with self._cond:
            self._closed = True
            left, self._queue = list(self._queue), deque()
        self._run_posted()  # they answer their requests (the queue is closed to them)
        self._answer([(p, None, stopping) for p in left])

    def _work_waiting(self) -> bool:
        return bool(self._queue or self._tasks or self._closed)

    def _poll_idle(self) -> bool:
        """Polls the poller, if any, with the lock released; True if work came meanwhile."""
        poller = self._poller
        if poller is None:
            return False
        start = time.perf_counter()
        self._metrics.launch_loop_busy.inc(start - self._busy_since)
        self._cond.release()
        try:
            found = poller.idle(self._work_waiting)
        finally:
            self._cond.acquire()
            self._busy_since = time.perf_counter()
        self._metrics.launch_loop_busy.inc(poller.take_busy())  # polling alone is idle
        return found or self._work_waiting()

    def _meanwhile(self) -> None:
        """Work to do while the device computes a launch."""
        self._poll_once()
        self._polled = True
        self._run_posted()

    def _poll_once(self) -> None:
        """Looks at the poller once, if there is one, outside an idle wait."""
        poller = self._poller
        if poller is not None:
            poller.poll()
            poller.take_busy()  # between or inside launches: counted busy already

    def _wait(self, timeout: float | None) -> None:
        """Waits on the condition (its lock held), counting the work since the last wait."""
        start = time.perf_counter()
        self._metrics.launch_loop_busy.inc(start - self._busy_since)
        self._cond.wait(timeout)
        self._busy_since = time.perf_counter()

    def _run_posted(self) -> None:
        """Runs the tasks posted so far (between launches, or inside one while the device
        computes)."""
        with self._cond:
            tasks, self._tasks = self._tasks, []
        for task in tasks:
            try:
                task()
            except Exception:
                log_event(log, "engine_task_failed", logging.ERROR, exc_info=True)

    def _take(self) -> list[_Pending]:
        """The next batch, removed from the queue (called with the lock held; the queue is
        not empty)."""
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
        answers: list[tuple[_Pending, ForwardOutput | None, BaseException | None]] = []
        meanwhile = self._meanwhile if self.settings.prepare_during_launch else None
        groups = [batch]
        while groups:
            group = groups.pop()
            try:
                self._watch.check()
                results = self._run([p.request for p in group], meanwhile)
            except BaseException as exc:
                fault = self._watch.observe(exc)
                if fault is not None:  # nobody's own error: no rerun on a lost context
                    answers.extend((p, None, DeviceFaultError(fault)) for p in group)
                    continue
                if len(group) > 1:  # retried alone: only who fails alone fails
                    groups.extend([p] for p in group)
                    continue
                answers.append((group[0], None, exc))
            else:
                answers.extend((p, r, None) for p, r in zip(group, results, strict=True))
        self._last_batch = time.perf_counter() - start
        self._answer(answers)

    @staticmethod
    def _answer(answers: list[tuple[_Pending, ForwardOutput | None, BaseException | None]]) -> None:
        flushes: dict[Flush, None] = {}  # each once, in order
        for pending, result, error in answers:
            try:
                pending.done(result, error)
            except Exception:
                log_event(log, "forward_callback_failed", logging.ERROR, exc_info=True)
            if pending.flush is not None:
                flushes[pending.flush] = None
        for flush in flushes:
            try:
                flush()
            except Exception:
                log_event(log, "forward_flush_failed", logging.ERROR, exc_info=True)
