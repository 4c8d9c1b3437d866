"""A direct channel's polled mailbox: the descriptor and the answer of one request at a time
in memory both processes map, so that a round trip makes no system call and wakes no thread.

The engine makes the block (a sealed ``memfd``: nobody can shrink it under a reader, so no
access ever faults) and hands its descriptor to the client over the channel's Unix socket with
the admitting STATE frame. The engine's launch loop polls every block between launches and
while the device computes; the client polls for its answer. Layout (little-endian):

======  ====  ======================================================================
offset  size  field
======  ====  ======================================================================
0       8     request seq: the client's request id, written after its descriptor
8       8     answer seq: the engine's answer's request id, written after the answer
16      4     engine polling: 1 while the launch loop polls; at 0 a client rings (BELL)
20      4     request length
24      4     request CRC-32
28      4     answer length
32      4     answer CRC-32
64      32 K  request area (a ``ForwardDescriptor``)
32 K+64 96 K  answer area (a ``ForwardResult``)
======  ====  ======================================================================

A reader takes a payload only when its CRC matches: a reader on a CPU that reorders stores
then sees a whole descriptor or none, never half of one.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import zlib

REQUEST_BYTES = 32 * 1024
ANSWER_BYTES = 96 * 1024
_HEADER = 64
_ANSWER_AT = _HEADER + REQUEST_BYTES
SIZE = _ANSWER_AT + ANSWER_BYTES
_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


class SpinBlock:
    """One channel's block, mapped from ``fd``. The client's side maps the descriptor it
    received and closes it; the engine's keeps its own (``fd``) until it has sent it."""

    def __init__(self, fd: int, keep_fd: bool = False) -> None:
        self.fd = fd if keep_fd else -1
        try:
            if os.fstat(fd).st_size < SIZE:
                raise ValueError(f"a spin block must hold {SIZE} bytes")
            self._map = mmap.mmap(fd, SIZE)
        finally:
            if not keep_fd:
                os.close(fd)
        view = memoryview(self._map)
        self._seq = view[0:16].cast("Q")  # [request, answer]
        self._word = view[16:36].cast("I")  # [polling, request len, crc, answer len, crc]
        self._request = view[_HEADER:_ANSWER_AT]
        self._answer = view[_ANSWER_AT:SIZE]
        self._views = (view, self._seq, self._word, self._request, self._answer)

    @classmethod
    def create(cls) -> SpinBlock:
        """A new block in a sealed memfd (the engine's side)."""
        fd = os.memfd_create("moelora-spin", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, SIZE)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, keep_fd=True)

    def sent(self) -> None:
        """The engine's side: the descriptor went to the client; the mapping stays."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    # -- the client's side ---------------------------------------------------------------------

    def post(self, request_id: int, payload: bytes) -> None:
        """Writes a request; ValueError if it does not fit (send fewer segments)."""
        if len(payload) > REQUEST_BYTES:
            raise ValueError(
                f"a descriptor of {len(payload)} bytes does not fit a spin block "
                f"({REQUEST_BYTES}); send fewer segments"
            )
        self._request[: len(payload)] = payload
        self._word[1] = len(payload)
        self._word[2] = zlib.crc32(payload)
        self._seq[0] = request_id

    def answer(self, request_id: int) -> bytes | None:
        """The answer to ``request_id`` once the engine wrote it whole, else None."""
        if self._seq[1] != request_id:
            return None
        length = self._word[3]
        if length > ANSWER_BYTES:
            return None
        payload = bytes(self._answer[:length])
        return payload if zlib.crc32(payload) == self._word[4] else None

    @property
    def engine_polling(self) -> bool:
        return bool(self._word[0])

    # -- the engine's side ---------------------------------------------------------------------

    def take(self, last: int) -> tuple[int, bytes] | None:
        """The request posted after request id ``last``, once written whole: (id, payload)."""
        request_id = self._seq[0]
        if request_id == last:
            return None
        length = self._word[1]
        if length > REQUEST_BYTES:
            return None
        payload = bytes(self._request[:length])
        if zlib.crc32(payload) != self._word[2]:
            return None
        return request_id, payload

    def reply(self, request_id: int, payload: bytes) -> None:
        """Writes the answer to ``request_id`` (at most ``ANSWER_BYTES``)."""
        if len(payload) > ANSWER_BYTES:
            raise ValueError(f"an answer of {len(payload)} bytes does not fit a spin block")
        self._answer[: len(payload)] = payload
        self._word[3] = len(payload)
        self._word[4] = zlib.crc32(payload)
        self._seq[1] = request_id

    def set_polling(self, polling: bool) -> None:
        self._word[0] = int(polling)

    def close(self) -> None:
        self.sent()
        for view in reversed(self._views):
            view.release()
        self._map.close()
