"""Who may open another WatchAdapters stream: the executor fleet first.

A watch is how executors learn that a version was deleted or an alias moved; an executor that
cannot watch serves what it cached. So other readers (tenants' read tokens, tools) may hold at
most ``max_per_token`` watches per token and half of the replica's ``capacity`` together; the
fleet's token (``fleet`` in the token file) and every caller while auth is off may use all of it.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable

from moelora.client.errors import Overloaded
from shared.tokens import Principal

#: The retry hint of a refused watch: executors reconnect with backoff anyway.
_RETRY_AFTER_MS = 5000


class WatchQuota:
    def __init__(self, capacity: int, max_per_token: int) -> None:
        self.capacity = capacity
        self.max_per_token = max_per_token
        self._lock = threading.Lock()
        self._total = 0
        self._others = 0
        self._by_token: Counter[str] = Counter()

    def acquire(self, caller: Principal) -> Callable[[], None]:
        """Counts a watch of ``caller``; the function that gives it back. Overloaded
        (RESOURCE_EXHAUSTED) when ``caller`` may open no more."""
        limited = caller.has_token and not caller.fleet
        with self._lock:
            if self._total >= self.capacity:
                raise Overloaded(
                    f"{self.capacity} WatchAdapters streams are open on this replica, the most "
                    "it serves (--max-watch-streams); retry later or on another replica",
                    _RETRY_AFTER_MS,
                )
            if limited and self._by_token[caller.token_sha256] >= self.max_per_token:
                raise Overloaded(
                    f"token {caller.name!r} has {self.max_per_token} WatchAdapters streams open "
                    "on this replica, the most one token may (--max-watch-streams-per-token)",
                    _RETRY_AFTER_MS,
                )
            if limited and self._others >= self.capacity // 2:
                raise Overloaded(
                    f"readers other than the executor fleet hold {self._others} WatchAdapters "
                    "streams, half of this replica's capacity, the most they may; retry later",
                    _RETRY_AFTER_MS,
                )
            self._total += 1
            if limited:
                self._others += 1
                self._by_token[caller.token_sha256] += 1

        def release() -> None:
            with self._lock:
                self._total -= 1
                if limited:
                    self._others -= 1
                    self._by_token[caller.token_sha256] -= 1
                    if not self._by_token[caller.token_sha256]:
                        del self._by_token[caller.token_sha256]

        return release
