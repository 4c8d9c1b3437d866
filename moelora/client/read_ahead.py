"""Where a byte stream is read and hashed ahead of the thread that sends it.

A gRPC sender waits for each message to go out before it asks for the next; reading and
hashing in that same thread would add both to every message. ``ReadAhead`` reads ``length``
bytes by a thread of its own, a few chunks ahead, hashing them on the way (hashlib releases
the GIL), so that the three overlap. The registry sends blobs through it, the client sends
uploads through it.
"""

from __future__ import annotations

import hashlib
import queue
import threading
from collections.abc import Iterator
from typing import BinaryIO

from moelora.client.errors import DataLoss

#: Chunks read ahead of the one being sent.
_DEPTH = 4
#: How often a blocked reader thread checks whether it was abandoned.
_POLL_SECONDS = 0.1


class ReadAhead:
    """Iterates ``length`` bytes of ``reader`` in chunks of ``chunk_size``, read (and hashed
    into ``hasher``) by a thread of its own; ``close`` it when done or abandoned. A reader
    that ends early raises DataLoss naming ``where``."""

    def __init__(
        self,
        reader: BinaryIO,
        length: int,
        chunk_size: int,
        hasher: hashlib._Hash | None,
        where: str,
    ) -> None:
        self._reader = reader
        self._length = length
        self._chunk_size = chunk_size
        self._hasher = hasher
        self._where = where
        self._queue: queue.Queue[bytes | BaseException | None] = queue.Queue(_DEPTH)
        self._abandoned = threading.Event()
        self._thread = threading.Thread(target=self._run, name="read-ahead", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            left = self._length
            while left and not self._abandoned.is_set():
                data = self._reader.read(min(self._chunk_size, left))
                if not data:
                    raise DataLoss(
                        f"{self._where} ends {left} bytes before its recorded size "
                        "(it is truncated)"
                    )
                if self._hasher is not None:
                    self._hasher.update(data)  # releases the GIL: overlaps the sender
                left -= len(data)
                self._put(data)
            self._put(None)
        except BaseException as exc:  # handed to the iterating thread
            self._put(exc)

    def _put(self, item: bytes | BaseException | None) -> None:
        while not self._abandoned.is_set():
            try:
                self._queue.put(item, timeout=_POLL_SECONDS)
                return
            except queue.Full:
                continue

    def __iter__(self) -> Iterator[bytes]:
        while (item := self._queue.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self) -> None:
        """Stops the thread (the stream ended or was abandoned) and waits for it."""
        self._abandoned.set()
        self._thread.join()

    def __enter__(self) -> ReadAhead:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
