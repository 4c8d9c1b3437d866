"""Where presigned-URL downloads are received: a helper process of the executor's own.

Receiving a cold adapter at 3–4 GB/s and hashing its pieces as they complete is work for
several cores, and in the executor's process it was also work for the GIL and the process's
page tables: eight download threads woke hundreds of times a second to take the GIL between
receive steps, and the page faults of the file they received into went through the same
address space as Forward's handlers. On an H100 host, Forward of other adapters ran 23–49%
slower during a cold load (docs/executor.md). So the executor hands each part to
``DownloadHelper``, which runs ``executor_service/download_helper_main.py`` as a child process:
the helper maps the disk-cache file the executor allocated, receives the part's bytes straight
into it (the page cache the executor's own map sees) and hashes each piece there. The executor
hears of one whole piece at a time with its sha256, which ``ArrivingFile`` compares with the
registry's, so the check stays the executor's and a bad piece is named as before.

The helper is started with the executor's source, restarted when it died (the reads it was
doing fail UNAVAILABLE, as a cut connection does, and the next load starts a new one) and runs
at the download's lower CPU priority. It exits when its stdin ends, so it never outlives the
executor. The registry's DownloadAdapter stream (no presigned URLs) is still received in the
executor's threads.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import subprocess
import sys
import threading
from typing import IO, Any

from executor_service.ranged_download import Part
from shared.logs import log_event
from shared.url_ranges import HttpStatusError, UrlUnreachable

log = logging.getLogger(__name__)

#: How long ``close`` waits for the helper to exit once its stdin closed, before killing it.
_EXIT_SECONDS = 5.0


class _Read:
    """A part handed to the helper, and how it ended."""

    def __init__(self, part: Part, process: subprocess.Popen[bytes]) -> None:
        self.part = part
        self.process = process
        self.error: BaseException | None = None
        self.ended = threading.Event()

    def end(self, error: BaseException | None) -> None:
        self.error = error
        self.ended.set()


class DownloadHelper:
    """Receives parts of files over presigned URLs in a helper process (see the module doc).
    Thread-safe: each download worker calls ``read`` for its part and blocks until it ends."""

    def __init__(self, *, timeout: float, nice: int, root_certificates: bytes | None) -> None:
        """``timeout``: of each socket operation of the helper's HTTP reads; ``nice``: how much
        lower the helper's CPU priority is; ``root_certificates``: PEM trusted besides the
        system's CAs (the registry's private CA)."""
        self._config = {
            "op": "config",
            "timeout": timeout,
            "nice": nice,
            "root_certificates": root_certificates.decode() if root_certificates else None,
        }
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        self._reads: dict[int, _Read] = {}
        self._ids = itertools.count(1)
        self._closed = False
        with self._lock:
            self._running()  # started now: the first cold load should not wait for it, and
            # one that cannot start stops the executor's start-up

    @property
    def pid(self) -> int | None:
        """The helper's process id, None while none runs (tests kill it by this)."""
        with self._lock:
            return self._process.pid if self._process is not None else None

    def read(self, url: str, part: Part) -> None:
        """Receives ``part`` of ``url``'s object into its file in the helper, reporting each
        piece to the part as it lands; returns when the part is whole, or early once the part
        says stop. Raises as ``UrlRangeReader.read_into`` does: UrlUnreachable (no connection
        could be made), HttpStatusError (an answer other than the range), ConnectionError (the
        transfer failed, or the helper exited)."""
        with self._lock:
            if self._closed:
                raise ConnectionError("the executor is closing: its download helper is stopped")
            process = self._running()
            ident = next(self._ids)
            read = self._reads[ident] = _Read(part, process)
            sent = self._send(
                process,
                {
                    "op": "read",
                    "id": ident,
                    "url": url,
                    "path": str(part.path),
                    "size": part.file_size,
                    "offset": part.offset,
                    "length": part.length,
                    "piece_size": part.piece_size,
                    "hash": part.piece_size > 0,
                },
            )
            if not sent:
                del self._reads[ident]
        if not sent:
            raise ConnectionError(f"the download helper (pid {process.pid}) exited")
        read.ended.wait()
        if read.error is not None:
            raise read.error

    def close(self) -> None:
        """Stops the helper: its stdin ends, so it exits (killed if it has not within
        ``_EXIT_SECONDS``). Reads still waiting fail."""
        with self._lock:
            self._closed = True
            process, self._process = self._process, None
        if process is None:
            return
        if process.stdin is not None:
            with contextlib.suppress(OSError):  # it had exited
                process.stdin.close()
        try:
            process.wait(_EXIT_SECONDS)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    # -- internals -----------------------------------------------------------------------

    def _running(self) -> subprocess.Popen[bytes]:
        """The helper, started if none runs (lock held)."""
        if self._process is not None and self._process.poll() is None:
            return self._process
        # The child imports our packages as this process does, wherever they came from.
        path = os.pathsep.join(p for p in sys.path if p)
        process = subprocess.Popen(
            [sys.executable, "-m", "executor_service.download_helper_main"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": path},
        )
        assert process.stdout is not None
        ready = process.stdout.readline() if self._send(process, self._config) else b""
        if ready.strip() != b'{"ready":true}':
            process.kill()
            raise ConnectionError(f"the download helper did not start (exit {process.wait()})")
        self._process = process
        threading.Thread(
            target=self._listen, args=(process,), name="download-helper", daemon=True
        ).start()
        log_event(log, "download_helper_started", pid=process.pid)
        return process

    def _send(self, process: subprocess.Popen[bytes], request: dict[str, Any]) -> bool:
        """Writes a request to the helper (lock held); False if it has exited."""
        stdin: IO[bytes] | None = process.stdin
        assert stdin is not None
        try:
            stdin.write(json.dumps(request, separators=(",", ":")).encode() + b"\n")
            stdin.flush()
        except (OSError, ValueError):  # a closed pipe, or stdin closed by close()
            return False
        return True

    def _listen(self, process: subprocess.Popen[bytes]) -> None:
        """Hands the helper's replies to the parts they are for, until it exits; then the
        reads it still had fail."""
        assert process.stdout is not None
        for line in process.stdout:
            reply = json.loads(line)
            ident = reply["id"]
            with self._lock:
                read = self._reads.get(ident)
            if read is None:
                continue  # a read stopped meanwhile
            if "arrived" in reply:
                begin, end = reply["arrived"]
                if not read.part.arrived(begin, end - begin, reply.get("sha256")):
                    self._stop(ident, read, process)
                continue
            with self._lock:
                self._reads.pop(ident, None)
            read.end(_error(reply))
        code = process.wait()
        with self._lock:
            lost = [(i, r) for i, r in self._reads.items() if r.process is process]
            for ident, _ in lost:
                del self._reads[ident]
            expected = self._closed
        if not expected:
            log_event(
                log, "download_helper_exited", logging.WARNING,
                pid=process.pid, code=code, reads_failed=len(lost),
            )  # fmt: skip
        for _, read in lost:
            read.end(ConnectionError(f"the download helper (pid {process.pid}) exited ({code})"))

    def _stop(self, ident: int, read: _Read, process: subprocess.Popen[bytes]) -> None:
        """The part said stop: the helper drops the rest and the part's worker returns."""
        with self._lock:
            self._reads.pop(ident, None)
            self._send(process, {"op": "cancel", "id": ident})
        read.end(None)


def _error(reply: dict[str, Any]) -> BaseException | None:
    """The exception a final reply stands for; None for ``done``."""
    kind = reply.get("error")
    if kind is None:
        return None
    message = str(reply.get("message", ""))
    if kind == "unreachable":
        return UrlUnreachable(message)
    if kind == "status":
        return HttpStatusError(int(reply["status"]), message)
    return ConnectionError(message)
