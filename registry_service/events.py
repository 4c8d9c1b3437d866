"""Where watch streams learn that new events exist.

One thread per process polls the newest event sequence (a one-row read) every
``poll_seconds``, which catches events committed by other replicas; commits
made in this process call ``notify`` and wake the streams at once. Streams then
read their events from the database, which stays the source of truth.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from moelora.client.logs import log_event

log = logging.getLogger(__name__)


class EventFeed:
    def __init__(self, latest_sequence: Callable[[], int], poll_seconds: float) -> None:
        self._read_latest = latest_sequence
        self._poll_seconds = poll_seconds
        self._changed = threading.Condition()
        self._latest = latest_sequence()
        self._poke = threading.Event()
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

    def notify(self) -> None:
        """Called after a commit that appended events: look now, not at the next poll."""
        self._poke.set()

    @property
    def latest(self) -> int:
        with self._changed:
            return self._latest

    def wait_beyond(self, sequence: int, timeout: float) -> int:
        """Blocks until an event after ``sequence`` exists or ``timeout`` passed;
        returns the newest sequence known."""
        with self._changed:
            self._changed.wait_for(
                lambda: self._latest > sequence or self._stop.is_set(), timeout=timeout
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
            with self._changed:
                if latest != self._latest:
                    self._latest = latest
                    self._changed.notify_all()
