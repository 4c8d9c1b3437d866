"""Where watch streams learn that new events exist, and read them.

One thread per process polls the newest event sequence (a one-row read) every
``poll_seconds``, which catches events committed by other replicas; commits
made in this process call ``notify`` and wake the streams at once. The same thread reads the
new events once (``fetch``) and keeps the last ``KEEP`` of them, which every stream filters in
memory: a fleet of watches costs one query per change, not one per watch. A stream further
behind reads from the database, which stays the source of truth.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

from moelora.client.logs import log_event
from registry_service.domain import Event

log = logging.getLogger(__name__)


#: Events kept in memory for the streams to read.
KEEP = 1000

#: Events with ``after < sequence <= upto``, oldest first, at most ``KEEP`` (unfiltered).
Fetch = Callable[[int, int], list[Event]]


class EventFeed:
    def __init__(
        self, latest_sequence: Callable[[], int], poll_seconds: float, fetch: Fetch | None = None
    ) -> None:
        self._read_latest = latest_sequence
        self._poll_seconds = poll_seconds
        self._fetch = fetch
        self._changed = threading.Condition()
        self._latest = latest_sequence()
        # The kept events are all those with _kept_from < sequence <= _kept_upto.
        self._recent: deque[Event] = deque(maxlen=KEEP)
        self._kept_from = self._kept_upto = self._latest
        self._poke = threading.Event()
        self._released = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="event-feed", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._poke.set()
        if self._thread.is_alive():  # one-off commands (gc, backfill-parts) never start it
            self._thread.join(5)
        with self._changed:
            self._changed.notify_all()

    def release(self) -> None:
        """Wakes every watch stream, now and from now on, to look whether it should stop (the
        server drains: none waits again)."""
        with self._changed:
            self._released = True
            self._changed.notify_all()

    def notify(self) -> None:
        """Called after a commit that appended events: look now, not at the next poll."""
        self._poke.set()

    @property
    def latest(self) -> int:
        with self._changed:
            return self._latest

    def wait_beyond(self, sequence: int, timeout: float) -> int:
        """Blocks until an event after ``sequence`` exists, ``release`` was called or
        ``timeout`` passed; returns the newest sequence known."""
        with self._changed:
            self._changed.wait_for(
                lambda: self._latest > sequence or self._stop.is_set() or self._released,
                timeout=timeout,
            )
            return self._latest

    def _run(self) -> None:
        while not self._stop.is_set():
            self._poke.wait(self._poll_seconds)
            self._poke.clear()
            if self._stop.is_set():
                return
            try:
                latest = self._read_latest()
            except Exception as exc:  # the database may be briefly unreachable
                log_event(log, "event_feed_poll_failed", logging.WARNING, error=str(exc))
                continue
            if latest == self._latest:
                continue
            try:
                events = self._fetch(self._kept_upto, latest) if self._fetch is not None else None
            except Exception as exc:
                log_event(log, "event_feed_read_failed", logging.WARNING, error=str(exc))
                events = None
            with self._changed:
                self._keep(events, latest)
                self._latest = latest
                self._changed.notify_all()

    def _keep(self, events: list[Event] | None, latest: int) -> None:
        if events is None or len(events) >= KEEP or latest < self._kept_upto:
            # Not read, too many, or another database: the streams read the database.
            self._recent.clear()
            self._kept_from = self._kept_upto = latest
            return
        for event in events:
            if len(self._recent) == KEEP:
                self._kept_from = self._recent.popleft().sequence
            self._recent.append(event)
        self._kept_upto = latest

    def recent(self, after: int, upto: int) -> list[Event] | None:
        """The events with ``after < sequence <= upto`` when they are all kept, else None."""
        with self._changed:
            if not self._kept_from <= after or upto > self._kept_upto:
                return None
            return [e for e in self._recent if after < e.sequence <= upto]
