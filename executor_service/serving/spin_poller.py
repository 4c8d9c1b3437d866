"""The launch loop's poll of direct channels' spin blocks (``moelora.client.spin_block``).

A channel that asks for it gets a block of memory shared with the engine: the client writes
its descriptor there and the launch loop finds it by polling, between launches and while the
device computes, then writes the answer there for the client to find. No socket, no thread
hand-off: what is left of a round trip is the request's own work.

Polling costs the loop's core, so the loop polls only while the blocks are busy: after
``spin_seconds`` with no request it says so in every block (``engine polling`` = 0), polls
once more and sleeps. A client that then posts rings the channel's BELL frame, which wakes the
loop. A store and a load on two CPUs may pass each other, so that a client can read "polling"
just as the loop stops; the sleeping loop therefore also looks at the blocks every
``SLEEP_SECONDS`` while any is open (a request missed that way waits that long, not forever).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

from moelora.client.spin_block import SpinBlock

#: How often a sleeping loop looks at the blocks anyway (see the module doc).
SLEEP_SECONDS = 0.01

L = TypeVar("L")


class SpinEntry(Generic[L]):
    """One channel's block, and the id of the last request taken from it."""

    def __init__(self, link: L, block: SpinBlock) -> None:
        self.link = link
        self.block = block
        self.last = 0
        self.lock = threading.Lock()  # answers come from worker threads too
        self.closed = False


class SpinPoller(Generic[L]):
    """The open blocks. ``handle(entry, payload, received)`` is called on the launch loop's
    thread for each request found (``received``: ``time.perf_counter()``)."""

    def __init__(
        self,
        spin_seconds: float,
        handle: Callable[[SpinEntry[L], bytes, float], None],
        max_blocks: int = 64,
    ) -> None:
        self.spin_seconds = spin_seconds
        self.max_blocks = max_blocks
        self._handle = handle
        self._lock = threading.Lock()
        self._entries: tuple[SpinEntry[L], ...] = ()  # replaced whole: the loop reads it bare
        self._polling = False
        self._active = 0.0  # when the last request was found
        self._woken = False  # a wake-up is on its way to the loop (``ring``)
        self._busy = 0.0  # seconds spent handing requests over since ``take_busy``

    def add(self, link: L) -> SpinEntry[L] | None:
        """A new block for ``link`` (the caller sends its ``block.fd`` and calls
        ``block.sent``), or None if ``max_blocks`` are open."""
        with self._lock:
            if len(self._entries) >= self.max_blocks:
                return None
            entry = SpinEntry(link, SpinBlock.create())
            entry.block.set_polling(self._polling)
            self._entries = (*self._entries, entry)
        return entry

    def remove(self, entry: SpinEntry[L]) -> None:
        """The channel ended: its block goes (an answer still to come is dropped)."""
        with self._lock:
            self._entries = tuple(e for e in self._entries if e is not entry)
        with entry.lock:
            entry.closed = True
            entry.block.close()

    def reply(self, entry: SpinEntry[L], request_id: int, payload: bytes) -> None:
        with entry.lock:
            if not entry.closed:
                entry.block.reply(request_id, payload)

    @property
    def sleep_timeout(self) -> float | None:
        """How long a sleeping loop may wait before looking at the blocks again."""
        return SLEEP_SECONDS if self._entries else None

    def poll(self) -> bool:
        """Hands over each request posted since the last look; True if there was one."""
        found = False
        for entry in self._entries:
            with entry.lock:
                taken = None if entry.closed else entry.block.take(entry.last)
                if taken is not None:
                    entry.last = taken[0]
            if taken is not None:
                found = True
                received = time.perf_counter()
                self._handle(entry, taken[1], received)
                self._busy += time.perf_counter() - received
        if found:
            self._active = time.perf_counter()
        return found

    def take_busy(self) -> float:
        """Seconds spent handing requests over (work, not polling) since the last call."""
        busy, self._busy = self._busy, 0.0
        return busy

    def ring(self) -> bool:
        """A client rang: whether to wake the loop. Bells while a wake-up is on its way, or
        while the loop polls, need none (a client ringing in a loop costs the loop nothing)."""
        if self._polling or self._woken:
            return False
        self._woken = True
        return True

    def idle(self, work_waiting: Callable[[], bool]) -> bool:
        """The loop has nothing to do: polls while the blocks were busy lately (until
        ``work_waiting()`` or a request), else looks once. True if it handed one over."""
        self._woken = False  # looked at from here on: a later bell wakes the loop again
        if not self._entries:
            self._set_polling(False)  # a block opened while the loop sleeps must ring
            return False
        if time.perf_counter() - self._active > self.spin_seconds:
            self._set_polling(False)  # clients ring from now on
            return self.poll()
        self._set_polling(True)
        while time.perf_counter() - self._active <= self.spin_seconds:
            if self.poll():
                return True
            if work_waiting():
                return False
            time.sleep(0)  # the other threads' turn at the interpreter
        self._set_polling(False)
        return self.poll()

    def _set_polling(self, polling: bool) -> None:
        if polling == self._polling:
            return
        with self._lock:
            self._polling = polling
            entries = self._entries
        for entry in entries:
            with entry.lock:
                if not entry.closed:
                    entry.block.set_polling(polling)
