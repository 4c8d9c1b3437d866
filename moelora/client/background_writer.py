"""Where streamed bytes reach the disk without stalling the stream: a file written by one
thread and hashed (sha256) by another, each through a short queue, so that receiving the next
chunk, hashing and writing (and flushing to disk) the last ones all overlap (hashlib and file
writes release the GIL). Asked for per-piece digests too, a third thread hashes each piece:
on a machine with the cores to spare it costs the stream nothing."""

from __future__ import annotations

import hashlib
import os
import queue
import threading
from collections.abc import Callable
from pathlib import Path

from moelora.client.part_digests import FileDigests, PartHasher

_DEPTH = 16  # chunks in flight per thread: 16 MiB with 1 MiB chunks


class BackgroundWriter:
    def __init__(self, path: Path, sync_every: int = 0, part_size: int = 0) -> None:
        """``sync_every``: bytes after which the writer flushes what it wrote to disk
        (fdatasync), so that a final ``close(sync=True)`` has only the tail left; 0: never.
        ``part_size``: also hash each piece of this many bytes (see moelora/client/part_digests.py);
        0: no pieces."""
        self.path = path
        self._sync_every = sync_every
        self._unsynced = 0
        self._error: BaseException | None = None
        self._hash = hashlib.sha256()
        self._parts = PartHasher(part_size) if part_size else None
        self._handle = path.open("wb")
        self._queues: list[queue.Queue[bytes | None]] = []
        self._threads: list[threading.Thread] = []
        workers: list[tuple[str, Callable[[bytes], object]]] = [
            ("writer", self._write),
            ("hasher", self._hash.update),
        ]
        if self._parts is not None:
            workers.append(("part-hasher", self._parts.update))
        for name, work in workers:
            inbox: queue.Queue[bytes | None] = queue.Queue(_DEPTH)
            thread = threading.Thread(
                target=self._drain, args=(inbox, work), name=name, daemon=True
            )
            self._queues.append(inbox)
            self._threads.append(thread)
            thread.start()

    def _drain(self, inbox: queue.Queue[bytes | None], work: Callable[[bytes], object]) -> None:
        while (data := inbox.get()) is not None:
            if self._error is None:
                try:
                    work(data)
                except BaseException as exc:
                    self._error = exc  # keep draining so that write() never blocks forever

    def _write(self, data: bytes) -> None:
        self._handle.write(data)
        self._unsynced += len(data)
        if self._sync_every and self._unsynced >= self._sync_every:
            self._handle.flush()
            os.fdatasync(self._handle.fileno())
            self._unsynced = 0

    def write(self, data: bytes) -> None:
        if self._error is not None:
            raise self._error
        for inbox in self._queues:
            inbox.put(data)

    def _stop(self) -> None:
        for inbox, thread in zip(self._queues, self._threads, strict=True):
            if thread.is_alive():
                inbox.put(None)
                thread.join()

    def close(self, *, sync: bool = False) -> FileDigests:
        """Waits for every byte to be written (and, with ``sync``, to be on disk); returns
        the sha256 of the bytes written and of their pieces. Raises what the threads ran
        into."""
        self._stop()
        try:
            if self._error is None and sync and not self._handle.closed:
                self._handle.flush()
                os.fsync(self._handle.fileno())
        finally:
            self._handle.close()
        if self._error is not None:
            raise self._error
        if self._parts is None:
            return FileDigests(self._hash.hexdigest(), 0, ())
        return FileDigests(self._hash.hexdigest(), self._parts.part_size, self._parts.finish())

    def discard(self) -> None:
        """Stops and removes the file, whatever state it is in (for cleanup after a
        failure, whose error is the one to report). Safe after ``close``."""
        self._stop()
        self._handle.close()
        self.path.unlink(missing_ok=True)
