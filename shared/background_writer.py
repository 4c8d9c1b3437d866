"""Where streamed bytes reach the disk without stalling the stream: a file written and
hashed (sha256) by a thread of its own through a short queue, so that receiving the next
chunk overlaps with hashing and writing the last ones (hashlib and file writes release the
GIL)."""

from __future__ import annotations

import hashlib
import os
import queue
import threading
from pathlib import Path

_DEPTH = 16  # chunks in flight: 16 MiB with 1 MiB chunks


class BackgroundWriter:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._queue: queue.Queue[bytes | None] = queue.Queue(_DEPTH)
        self._error: BaseException | None = None
        self._hash = hashlib.sha256()
        self._handle = path.open("wb")
        self._thread = threading.Thread(target=self._run, name="writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (data := self._queue.get()) is not None:
            if self._error is None:
                try:
                    self._hash.update(data)
                    self._handle.write(data)
                except BaseException as exc:
                    self._error = exc  # keep draining so that write() never blocks forever

    def write(self, data: bytes) -> None:
        if self._error is not None:
            raise self._error
        self._queue.put(data)

    def _stop(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()

    def close(self, *, sync: bool = False) -> str:
        """Waits for every byte to be written (and, with ``sync``, to be on disk); returns
        the lower-case hex sha256 of the bytes written. Raises what the thread ran into."""
        self._stop()
        try:
            if self._error is None and sync and not self._handle.closed:
                self._handle.flush()
                os.fsync(self._handle.fileno())
        finally:
            self._handle.close()
        if self._error is not None:
            raise self._error
        return self._hash.hexdigest()

    def discard(self) -> None:
        """Stops and removes the file, whatever state it is in (for cleanup after a
        failure, whose error is the one to report). Safe after ``close``."""
        self._stop()
        self._handle.close()
        self.path.unlink(missing_ok=True)
