"""Whether the registry answers, as the executor last saw it: one WARNING when an outage
starts and one line when it ends (not one per request), the start time for the metric and
GetExecutorInfo, and the pace of probes while it lasts.

Every registry call of the executor reports here: an answer (``answered``) ends an outage, a
call that found no registry (``failed``) starts one. While one lasts, a reference the executor
never resolved fails at once rather than waiting on a registry known to be gone; one call per
``probe_seconds`` still goes out (``may_probe``) to find it back.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from moelora.client.logs import log_event

log = logging.getLogger(__name__)

#: While the registry is unreachable, at most one call per this many seconds looks for it.
PROBE_SECONDS = 1.0


class RegistryOutage:
    """The registry at ``address`` as last seen; thread-safe. ``on_change(start)`` is called
    with the outage's start (Unix time) when one begins and with None when it ends."""

    def __init__(
        self,
        address: str,
        on_change: Callable[[float | None], None] | None = None,
        probe_seconds: float = PROBE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.address = address
        self._on_change = on_change
        self._probe_seconds = probe_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._since: float | None = None  # Unix time of the first failed call
        self._started: float = 0.0  # the same, on the monotonic clock
        self._last_probe = float("-inf")

    @property
    def since(self) -> float | None:
        """Unix time the current outage started; None while the registry answers."""
        with self._lock:
            return self._since

    @property
    def down(self) -> bool:
        with self._lock:
            return self._since is not None

    def failed(self, error: str) -> None:
        """A call found no registry (UNAVAILABLE or past its deadline)."""
        with self._lock:
            if self._since is not None:
                return
            self._since, self._started = time.time(), self._clock()
            self._last_probe = self._started
            since = self._since
        log_event(
            log, "registry_unreachable_serving_cached", logging.WARNING,
            registry=self.address, error=error,
            hint="serving what this executor already resolved and holds; new references "
            "fail UNAVAILABLE until the registry answers again",
        )  # fmt: skip
        if self._on_change is not None:
            self._on_change(since)

    def answered(self) -> None:
        """A call got an answer (any answer: NOT_FOUND is one)."""
        with self._lock:
            if self._since is None:
                return
            seconds = self._clock() - self._started
            self._since = None
        log_event(
            log, "registry_reachable_again", registry=self.address, outage_s=round(seconds, 1)
        )
        if self._on_change is not None:
            self._on_change(None)

    def may_probe(self) -> bool:
        """True (and counted) when a call may go out to look for the registry now: always
        while it answers, once per ``probe_seconds`` during an outage."""
        with self._lock:
            if self._since is None:
                return True
            now = self._clock()
            if now - self._last_probe < self._probe_seconds:
                return False
            self._last_probe = now
            return True

    @property
    def probe_seconds(self) -> float:
        """How long a caller turned away during an outage should wait before trying again."""
        return self._probe_seconds
