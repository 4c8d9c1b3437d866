"""The download helper's program: receives ranges of presigned URLs into disk-cache files and
hashes their pieces, in a process of its own (see executor_service/download_helper.py, which
starts it and speaks to it).

It imports no torch and no gRPC: only the URL reader and the standard library, so it starts in
a fraction of a second and its threads never contend with the executor's for a GIL or a page
table. The executor writes requests to its stdin and reads replies from its stdout, one JSON
object per line:

* ``{"op": "config", "timeout": s, "nice": n, "root_certificates": pem | null}``, first,
  answered ``{"ready": true}``;
* ``{"op": "read", "id": i, "url": u, "path": p, "size": file bytes, "offset": o,
  "length": n, "piece_size": bytes or 0, "hash": bool}``: receive bytes ``o`` to ``o + n``
  of ``u`` into file ``p`` (which the executor allocated) on a thread of its own;
* ``{"op": "cancel", "id": i}``: stop that read at its next receive step.

For each read it answers ``{"id": i, "arrived": [begin, end], "sha256": hex | null}`` as bytes
land: one piece at a time with the piece's sha256 when ``hash`` (the read covers whole pieces),
else about ``_REPORT_BYTES`` at a time; then ``{"id": i, "done": true}``, or ``{"id": i,
"error": kind, "status": http status, "message": text}`` where kind is ``unreachable`` (no
connection could be made), ``status`` (an answer other than the range) or ``transport``. The
helper checks nothing itself: the executor compares the digests. At the end of its stdin (the
executor closed it, or died) it exits.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import os
import sys
import threading
from pathlib import Path
from typing import IO, Any

from shared.url_ranges import HttpStatusError, UrlRangeReader, UrlUnreachable, tls_context

#: Bytes received between reports when pieces are not hashed here (the executor hashes the
#: file in order behind them): few enough reports to cost the executor nothing.
_REPORT_BYTES = 16 << 20


class _Replies:
    """stdout, one JSON line per reply, from many threads."""

    def __init__(self, out: IO[bytes]) -> None:
        self._out = out
        self._lock = threading.Lock()

    def send(self, reply: dict[str, Any]) -> None:
        line = json.dumps(reply, separators=(",", ":")).encode() + b"\n"
        with self._lock:
            self._out.write(line)
            self._out.flush()


class _Read:
    """One ``read`` request, received on its own thread."""

    def __init__(self, request: dict[str, Any], urls: UrlRangeReader, replies: _Replies) -> None:
        self.id: int = request["id"]
        self.cancelled = threading.Event()
        self._request = request
        self._urls = urls
        self._replies = replies

    def run(self) -> None:
        request = self._request
        offset, length = int(request["offset"]), int(request["length"])
        # A map starts at a multiple of the allocation granularity: map from there.
        lead = offset % mmap.ALLOCATIONGRANULARITY
        try:
            if length:
                with Path(request["path"]).open("r+b") as file:
                    mapped = mmap.mmap(
                        file.fileno(), lead + length, offset=offset - lead, access=mmap.ACCESS_WRITE
                    )
                whole = memoryview(mapped)
                view = whole[lead:]
                try:
                    self._receive(request["url"], offset, view)
                finally:
                    view.release()
                    whole.release()
                    # A view still held by a traceback: the map is left to the GC.
                    with contextlib.suppress(BufferError):
                        mapped.close()
        except UrlUnreachable as exc:
            self._reply(error="unreachable", message=str(exc))
        except HttpStatusError as exc:
            self._reply(error="status", status=exc.status, message=exc.message)
        except Exception as exc:  # the executor waits for an answer to every read
            self._reply(error="transport", message=f"{type(exc).__name__}: {exc}")
        else:
            self._reply(done=True)

    def _receive(self, url: str, offset: int, view: memoryview) -> None:
        """Receives into ``view`` (the file's bytes from ``offset``), reporting each piece (or
        each ``_REPORT_BYTES``) once it is whole."""
        request = self._request
        size, piece = int(request["size"]), int(request["piece_size"])
        hashed = bool(request["hash"]) and piece > 0
        grain = piece if hashed else _REPORT_BYTES
        reported = offset  # file offset up to which arrivals were reported

        def arrived(at: int, n: int) -> bool:
            nonlocal reported
            if self.cancelled.is_set():
                return False
            end = at + n
            while reported < end:
                # The next boundary: a grain from the file's start, or the read's end.
                boundary = min(offset + len(view), size, (reported // grain + 1) * grain)
                if boundary > end:
                    break
                digest = None
                if hashed:
                    digest = hashlib.sha256(view[reported - offset : boundary - offset]).hexdigest()
                self._reply(arrived=[reported, boundary], sha256=digest)
                reported = boundary
            return True

        self._urls.read_into(url, offset, view, arrived)

    def _reply(self, **fields: Any) -> None:
        self._replies.send({"id": self.id, **fields})


def serve(requests: IO[bytes], out: IO[bytes]) -> None:
    """Answers ``requests`` (see the module doc) until their end."""
    replies = _Replies(out)
    config = json.loads(requests.readline() or b"{}")
    if config.get("op") != "config":
        raise SystemExit("download helper: the first request must be a config")
    if config.get("nice", 0) > 0:
        os.nice(int(config["nice"]))
    certificates = config.get("root_certificates")
    urls = UrlRangeReader(
        timeout=float(config["timeout"]),
        ssl_context=tls_context(certificates.encode() if certificates else None),
    )
    replies.send({"ready": True})
    reads: dict[int, _Read] = {}
    lock = threading.Lock()

    def run(read: _Read) -> None:
        try:
            read.run()
        finally:
            with lock:
                reads.pop(read.id, None)

    for line in requests:
        request = json.loads(line)
        if request["op"] == "read":
            read = _Read(request, urls, replies)
            with lock:
                reads[read.id] = read
            threading.Thread(target=run, args=(read,), name=f"read-{read.id}", daemon=True).start()
        elif request["op"] == "cancel":
            with lock:
                cancelled = reads.get(request["id"])
            if cancelled is not None:
                cancelled.cancelled.set()


def main() -> None:
    with contextlib.suppress(BrokenPipeError, KeyboardInterrupt):
        serve(sys.stdin.buffer, sys.stdout.buffer)
    # Reads still running belong to an executor that is gone or closing: no need to wait.
    os._exit(0)


if __name__ == "__main__":
    main()
