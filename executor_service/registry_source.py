"""Adapters from the registry: resolve over gRPC, download through the disk cache, and follow
the registry's change stream so that cached answers stay true.

``RegistrySource`` is the executor's ``AdapterSource`` when ``--registry-address`` is set.

* References are resolved with GetAdapter (deadline ``resolve_timeout``) and remembered
  (``Resolutions``): an answer is trusted while ``RegistryWatcher`` is connected, which drops it
  the moment the registry announces a new version, an alias move or a deletion, and for
  ``staleness_seconds`` after the registry last gave it; past that it is asked again before
  use. A Forward never waits on a registry known to be down.
* Files are fetched by digest (``name@sha256:...``, so an alias moving mid-download cannot
  change the bytes) as parallel ranged reads (``--download-streams``): over presigned URLs
  when the blob store offers them, the registry's DownloadAdapter stream otherwise. Each file
  is checked as it arrives (piece by piece in parallel where the registry recorded piece
  digests, else hashed in order), the packer reads the weights as they arrive, and
  ``finish`` (nothing is published before it) checks every file and keeps them in
  ``DiskCache``.
* When the registry cannot be reached, what the executor already knows keeps serving at full
  speed: remembered resolutions, however stale (kept on disk too, for a restart during the
  outage), and the disk cache (the host and GPU tiers above them too). ``RegistryOutage`` logs
  the outage once, and a reference never resolved fails UNAVAILABLE at once, saying when to
  retry. A call per second looks for the registry in the background (and refreshes what it
  asked for); the watcher reconnects by itself with backoff and replays what it missed.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Callable
from http import HTTPStatus
from http.client import HTTPException
from pathlib import Path
from typing import Any

from executor_service.disk_cache import DiskCache
from executor_service.listing import RemoteFile
from executor_service.ranged_download import Part, RangedDownload, RangeReader
from executor_service.registry_outage import RegistryOutage
from executor_service.resolutions import DEFAULT_STALENESS_SECONDS, Resolutions
from executor_service.sources import (
    AdapterFiles,
    AdapterSource,
    ResolvedAdapter,
    check_digest,
    parse_config,
)
from moelora.client.adapter_files import ADAPTER_FILES, CONFIG_FILE, WEIGHTS_FILE, files_digest
from moelora.client.errors import (
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    MoeLoraError,
    NotFound,
    OutOfRange,
    ResourceExhausted,
    Unavailable,
)
from moelora.client.logs import log_event
from moelora.client.part_digests import Pieces
from moelora.client.registry import RegistryClient, WatchStream
from moelora.v1 import registry_pb2
from shared.refs import AdapterRef
from shared.url_ranges import HttpStatusError, UrlRangeReader, UrlUnreachable

log = logging.getLogger(__name__)

EventType = registry_pb2.AdapterEventType

#: Errors that mean "the registry did not answer", as opposed to an answer that says no.
_UNREACHABLE = (Unavailable, DeadlineExceeded)
#: A part read over the DownloadAdapter stream gets the client's call deadline plus a second
#: per MiB (a part is at most 64 MiB): a registry that stops sending over a live connection
#: (keepalive finds a dead one) fails the part instead of holding the load forever.
_SLOWEST_STREAM_BYTES_PER_SECOND = 1 << 20
#: After presigned URLs could not be connected to (say a registry whose --http-public-url
#: names a host executors cannot reach), downloads take the DownloadAdapter stream this long
#: before URLs are tried again.
_URLS_RETRY_SECONDS = 300.0
#: Default deadline of a resolution (GetAdapter) that a request waits on: a registry that
#: accepts connections but does not answer (stopped, overloaded) costs at most this, once.
DEFAULT_RESOLVE_TIMEOUT_SECONDS = 2.0


class RegistrySource:
    """Resolves and fetches adapters from the registry at ``address`` (see the module doc)."""

    def __init__(
        self,
        client: RegistryClient,
        address: str,
        disk: DiskCache,
        streams: int,
        nice: int,
        urls: UrlRangeReader | None = None,
        *,
        staleness_seconds: float = DEFAULT_STALENESS_SECONDS,
        resolve_timeout: float = DEFAULT_RESOLVE_TIMEOUT_SECONDS,
        outage: RegistryOutage | None = None,
    ) -> None:
        """``streams``: parallel ranged reads per download (``client`` should have as many
        connections); ``nice``: how much lower the download threads' CPU priority is;
        ``urls``: reads presigned URLs (default: plain trust, ``client``'s timeout);
        ``staleness_seconds``: how long an answer the watch does not cover is trusted;
        ``resolve_timeout``: deadline of a GetAdapter a request waits on; ``outage``: where
        calls report whether the registry answered (the metric and GetExecutorInfo read it)."""
        self.client = client
        self.urls = urls or UrlRangeReader(timeout=client.timeout)
        self.address = address
        self.outage = outage or RegistryOutage(address)
        self.resolutions = Resolutions(disk, staleness_seconds)
        self._resolve_timeout = min(resolve_timeout, client.timeout)
        self._disk = disk
        self._streams = streams
        self._nice = nice
        self._lock = threading.Lock()
        #: References a background call is asking the registry about.
        self._probing: set[str] = set()
        #: None until we know whether the blob store presigns URLs.
        self._presign: bool | None = None
        #: Until when (time.monotonic) URLs are not used because they could not be reached.
        self._urls_unreachable_until = 0.0

    # -- AdapterSource -------------------------------------------------------------------

    def resolve_at_once(self, ref: AdapterRef) -> ResolvedAdapter | None:
        """A fresh answer from memory; None when the registry would have to be asked."""
        found = self.resolutions.lookup(str(ref))
        if found.resolution is not None and found.fresh:
            return found.resolution.adapter
        return None

    def resolve(self, ref: AdapterRef) -> ResolvedAdapter:
        key = str(ref)
        found = self.resolutions.lookup(key)
        known = found.resolution
        if known is not None and found.fresh:
            return known.adapter
        if self.outage.down:
            # Never wait on a registry known to be gone: serve what is known, and let one call
            # a second look for the registry in the background.
            if self.outage.may_probe():
                self._ask_in_background(key)
            if known is not None:
                return known.adapter
            raise self._never_resolved(key, "it has not answered since")
        try:
            return self._ask(key, found.generation)
        except _UNREACHABLE as exc:
            if known is not None:
                return known.adapter
            raise self._never_resolved(key, exc.message) from None

    def _ask(self, key: str, generation: tuple[int, int]) -> ResolvedAdapter:
        """The registry's answer for ``key``, remembered; reports to ``outage``."""
        try:
            version = self.client.get(key, timeout=self._resolve_timeout)
        except NotFound:
            self.outage.answered()
            self.resolutions.drop(key)
            raise
        except _UNREACHABLE as exc:
            self.outage.failed(f"GetAdapter {key}: {exc.message}")
            raise
        self.outage.answered()
        adapter = ResolvedAdapter(
            name=version.name,
            version=version.version,
            digest=version.digest,
            base_model_fingerprint=version.base_model_fingerprint or None,
            rank=version.rank or None,
        )
        self.resolutions.store(key, adapter, generation)
        return adapter

    def _ask_in_background(self, key: str) -> None:
        with self._lock:
            if key in self._probing:
                return
            self._probing.add(key)

        def ask() -> None:
            try:
                self._ask(key, self.resolutions.lookup(key).generation)
            except MoeLoraError:
                pass  # reported to the outage tracker; the next use tries again
            finally:
                with self._lock:
                    self._probing.discard(key)

        threading.Thread(target=ask, name="registry-probe", daemon=True).start()

    def status(self) -> dict[str, Any]:
        """What GetExecutorInfo says of the registry, as the engine sends it to its front ends
        (``registry_status_message`` makes the message of it)."""
        return {
            "address": self.address,
            "reachable": not self.outage.down,
            "unreachable_since": self.outage.since,
            "watching": self.resolutions.is_watching,
            "staleness_seconds": self.resolutions.staleness_seconds,
        }

    def _never_resolved(self, key: str, why: str) -> Unavailable:
        return Unavailable(
            f"adapter {key}: the registry at {self.address} cannot be reached ({why}) and this "
            f"executor has not resolved {key} before; retry in {self.outage.probe_seconds:g} s "
            "or more (adapters it resolved before keep serving)"
        )

    def fetch(self, adapter: ResolvedAdapter) -> AdapterFiles:
        folder = self._disk.get(adapter.digest)
        if folder is not None:
            return _files_in(adapter, folder, where=f"the disk cache {self._disk.root}")
        while True:
            try:
                return self._start_download(adapter)
            except OSError as exc:
                # A full volume (below the byte budget: shared, or the budget is too big):
                # make room from the least recently used entries and try again. The files
                # are allocated before the first byte is fetched, so this is where it shows.
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                if not self._disk.shed():
                    raise ResourceExhausted(
                        f"adapter {adapter.label}: the disk cache volume {self._disk.root} is "
                        f"full ({exc.strerror}) and holds nothing to evict; free space or "
                        "lower --disk-cache-bytes"
                    ) from None

    def _start_download(self, adapter: ResolvedAdapter) -> AdapterFiles:
        """Starts downloading ``adapter`` into a reserved disk-cache folder and returns once
        its config arrived: the weights arrive while the packer reads them (see
        executor_service/ranged_download.py); ``finish`` checks and keeps them."""
        partial = self._disk.reserve()
        try:
            files, read, how = self._plan(adapter)
            where = f"the registry at {self.address}"
            # The listing itself must be the version asked for: then checking each file's
            # sha256 checks the digest, without reading the files again.
            check_digest(adapter, files_digest({f.path: f.sha256 for f in files}), where)
            download = RangedDownload(
                partial, files, read, self._streams, f"adapter {adapter.label}", self._nice
            )
        except BaseException:
            self._disk.discard(partial)
            raise
        start = time.perf_counter()
        try:
            config_file = download.file(CONFIG_FILE)
            config_file.wait_verified()
            config = parse_config(adapter, bytes(config_file.view()), where)
        except BaseException:
            download.close()
            self._disk.discard(partial)
            raise
        size = sum(f.size for f in files)

        def finish() -> None:
            download.wait_verified()
            log_event(
                log,
                "adapter_downloaded",
                adapter=adapter.label,
                digest=adapter.digest,
                bytes=size,
                via=how,
                streams=self._streams,
                seconds=round(time.perf_counter() - start, 4),
            )
            if download.file(WEIGHTS_FILE).size <= self._disk.budget_bytes:
                self._keep(adapter, partial, files)  # else too big to keep: dropped at close

        def close() -> None:
            download.close()
            self._disk.discard(partial)  # nothing left there once committed

        return AdapterFiles(config, download.file(WEIGHTS_FILE), finish, close)

    def _keep(self, adapter: ResolvedAdapter, partial: Path, files: list[RemoteFile]) -> None:
        """Moves a checked download into the disk cache, making room on a full volume (the
        files are allocated, but the entry's small version file may not fit). With nothing
        left to evict it keeps nothing: the load goes on, from the download."""
        while True:
            try:
                self._disk.commit(adapter, partial, files)
                return
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                if not self._disk.shed():
                    log_event(
                        log, "disk_cache_not_kept", logging.WARNING,
                        adapter=adapter.label, error=exc.strerror,
                    )  # fmt: skip
                    return

    def cached(self) -> list[ResolvedAdapter]:
        return [entry.adapter for entry in self._disk.entries()]

    def close(self) -> None:
        self.urls.close()  # kept-alive connections to the blob store

    # -- the watcher's side --------------------------------------------------------------

    def watching(self, connected: bool, *, resumed: bool = True) -> None:
        """Called by the watcher when its stream connects (``resumed``: it carries on from
        the last event seen, so no move was missed) or ends."""
        self.resolutions.watching(connected, resumed=resumed)

    def apply(self, event: registry_pb2.WatchAdaptersResponse) -> None:
        """Drops the resolutions an event makes stale; a deleted version also leaves the
        disk cache."""
        self.resolutions.changed(event.name, lambda ref, cached: _made_stale(ref, cached, event))
        if event.type == EventType.ADAPTER_EVENT_TYPE_DELETED:
            self._disk.remove(event.digest)

    # -- internals -----------------------------------------------------------------------

    def _plan(self, adapter: ResolvedAdapter) -> tuple[list[RemoteFile], RangeReader, str]:
        """The version's files and how to read ranges of them: presigned URLs when the blob
        store offers them, else the registry's DownloadAdapter stream. Registry errors that
        mean "not reachable" become Unavailable naming the adapter."""
        ref = f"{adapter.name}@{adapter.digest}"
        try:
            if self._presign is not False and time.monotonic() >= self._urls_unreachable_until:
                try:
                    urls = self.client.download_urls(ref)
                    self._presign = True
                    reader = self._url_reader(adapter, urls, self._stream_reader(adapter, ref))
                    return _remote(urls.version), reader, "presigned"
                except FailedPrecondition:
                    self._presign = False  # the local-directory store: the stream from now on
            version = self.client.get(ref)
        except _UNREACHABLE as exc:
            raise self._unreachable(adapter, exc) from None
        return _remote(version), self._stream_reader(adapter, ref), "stream"

    def _stream_reader(self, adapter: ResolvedAdapter, ref: str) -> RangeReader:
        def read(part: Part) -> None:
            deadline = self.client.timeout + part.length / _SLOWEST_STREAM_BYTES_PER_SECOND
            try:
                for at, data in self.client.read_range(
                    ref, part.index, part.offset, part.length, timeout=deadline
                ):
                    if not part.write(at, data):
                        return
            except _UNREACHABLE as exc:
                raise self._unreachable(adapter, exc) from None

        return read

    def _url_reader(
        self,
        adapter: ResolvedAdapter,
        urls: registry_pb2.GetDownloadUrlsResponse,
        stream: RangeReader,
    ) -> RangeReader:
        """Reads parts over the URLs; a part whose URL cannot be connected to is read from
        ``stream`` instead (and URLs rest for a while: see ``_URLS_RETRY_SECONDS``)."""
        links = [f.url for f in urls.files]

        def read(part: Part) -> None:
            where = f"adapter {adapter.label}: the blob store behind {self.address}"
            try:
                self.urls.read(links[part.index], part.offset, part.length, part)
            except UrlUnreachable as exc:  # before any byte of the part: nothing to undo
                self._urls_unreachable_until = time.monotonic() + _URLS_RETRY_SECONDS
                log_event(
                    log, "blob_urls_unreachable", logging.WARNING,
                    adapter=adapter.label, error=str(exc), stream_seconds=_URLS_RETRY_SECONDS,
                    hint="the registry's --http-public-url must name a host executors reach",
                )  # fmt: skip
                stream(part)
            except HttpStatusError as exc:
                if exc.status == HTTPStatus.NOT_FOUND:  # as DownloadAdapter says of it
                    raise DataLoss(
                        f"{where} has lost the blob of file {part.index} ({exc})"
                    ) from None
                raise Unavailable(f"{where} refused a ranged read ({exc}); retry") from None
            except (OSError, HTTPException) as exc:
                raise Unavailable(f"{where} failed ({exc!r}); retry") from None

        return read

    def _unreachable(self, adapter: ResolvedAdapter, exc: MoeLoraError) -> Unavailable:
        self.outage.failed(f"download of {adapter.label}: {exc.message}")
        return Unavailable(
            f"adapter {adapter.label}: the registry at {self.address} cannot be reached "
            f"({exc.message}) and the adapter is in none of this executor's caches"
        )


def registry_status(source: AdapterSource | None) -> dict[str, Any] | None:
    """GetExecutorInfo's registry detail; None when adapters do not come from a registry."""
    return source.status() if isinstance(source, RegistrySource) else None


def _remote(version: registry_pb2.AdapterVersion) -> list[RemoteFile]:
    """The version's files in the registry's order (config first), as the download takes them."""
    files = [
        RemoteFile(
            f.path,
            f.size_bytes,
            f.sha256,
            Pieces(f.part_size_bytes, tuple(f.part_sha256)) if f.part_size_bytes else None,
        )
        for f in version.files
    ]
    if sorted(f.path for f in files) != sorted(ADAPTER_FILES):
        raise DataLoss(f"the registry lists files {[f.path for f in files]}, not {ADAPTER_FILES}")
    return files


def _files_in(adapter: ResolvedAdapter, folder: Path, where: str) -> AdapterFiles:
    """A checked disk-cache entry as the packer takes it: the weights stay on disk."""
    config = parse_config(adapter, (folder / CONFIG_FILE).read_bytes(), where)
    return AdapterFiles(config, folder / WEIGHTS_FILE)


def _made_stale(
    ref: AdapterRef, cached: ResolvedAdapter, event: registry_pb2.WatchAdaptersResponse
) -> bool:
    """Whether ``event`` (of ``ref``'s adapter name) may change what ``ref`` resolves to."""
    if event.type == EventType.ADAPTER_EVENT_TYPE_READY:
        return ref.alias is None and not ref.is_pinned_version  # the bare name moves on
    if event.type in (
        EventType.ADAPTER_EVENT_TYPE_ALIAS_SET,
        EventType.ADAPTER_EVENT_TYPE_ALIAS_DELETED,
    ):
        return ref.alias == event.alias
    if event.type == EventType.ADAPTER_EVENT_TYPE_DELETED:
        # Digest references stay resolvable (until gc); everything else that pointed there
        # (the version number, the bare name, aliases) does not.
        return cached.digest == event.digest and ref.digest is None
    return False


class RegistryWatcher:
    """Follows WatchAdapters in a thread of its own, feeding events to the source and the
    deletions to ``on_deleted(digest)`` (the adapter manager drops the version from its
    tiers), and every event to ``on_event`` (the prefetcher; it must not block). Reconnects
    with exponential backoff, resuming after the last sequence it saw; when the registry no
    longer keeps that far back it starts afresh."""

    def __init__(
        self,
        client: RegistryClient,
        source: RegistrySource,
        on_deleted: Callable[[str], None],
        backoff: tuple[float, float] = (0.2, 10.0),
        on_event: Callable[[registry_pb2.WatchAdaptersResponse], None] | None = None,
    ) -> None:
        self.client = client
        self._source = source
        self._on_deleted = on_deleted
        self._on_event = on_event
        self._backoff = backoff
        self._stop = threading.Event()
        self._stream_lock = threading.Lock()
        self._stream: WatchStream | None = None
        self._last_sequence = 0
        #: Set whenever a stream is live (tests and start-up wait on it).
        self.connected = threading.Event()
        self._thread = threading.Thread(target=self._run, name="registry-watch", daemon=True)

    @property
    def last_sequence(self) -> int:
        """The sequence of the last event fully handled (0 before the first stream)."""
        return self._last_sequence

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        with self._stream_lock:
            stream = self._stream
        if stream is not None:
            stream.cancel()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        delay = self._backoff[0]
        while not self._stop.is_set():
            resumed = self._last_sequence > 0
            try:
                with self.client.watch(after_sequence=self._last_sequence) as stream:
                    with self._stream_lock:
                        self._stream = stream
                    if self._stop.is_set():
                        return
                    if not resumed:
                        self._last_sequence = stream.start_sequence
                    self._source.outage.answered()
                    self._source.watching(True, resumed=resumed)
                    self.connected.set()
                    log_event(log, "registry_watch_connected", after=self._last_sequence)
                    delay = self._backoff[0]
                    for event in stream:
                        self._source.apply(event)
                        if event.type == EventType.ADAPTER_EVENT_TYPE_DELETED:
                            self._on_deleted(event.digest)
                        if self._on_event is not None:
                            self._on_event(event)
                        self._last_sequence = event.sequence
            except OutOfRange:
                log_event(log, "registry_watch_history_lost", logging.WARNING)
                self._last_sequence = 0
            except _UNREACHABLE as exc:
                # The outage is logged once, there; each reconnect attempt only at debug.
                self._source.outage.failed(f"WatchAdapters: {exc.message}")
                log_event(
                    log, "registry_watch_failed", logging.DEBUG,
                    error=exc.message, retry_seconds=round(delay, 2),
                )  # fmt: skip
            except MoeLoraError as exc:
                # Refused (say RESOURCE_EXHAUSTED: no watch capacity left): answers are
                # asked again once stale instead of being trusted.
                log_event(
                    log, "registry_watch_failed", logging.WARNING,
                    error=exc.message, retry_seconds=round(delay, 2),
                    hint="without the watch, resolutions are re-checked every "
                    f"{self._source.resolutions.staleness_seconds:g} s",
                )  # fmt: skip
            finally:
                self._source.watching(False)
                self.connected.clear()
                with self._stream_lock:
                    self._stream = None
            if self._stop.wait(delay):
                return
            delay = min(delay * 2, self._backoff[1])
