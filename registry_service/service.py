"""The registry's logic as a plain Python class: uploads, reads, aliases,
deletes, watches and gc over the SQL store and the blob store. The gRPC
servicer only translates messages; tests drive this class directly."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import closing
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import TypeVar

from moelora.client.adapter_files import CONFIG_FILE, WEIGHTS_FILE, files_digest
from moelora.client.errors import DataLoss, InvalidArgument, MoeLoraError, OutOfRange
from moelora.client.logs import log_event
from moelora.client.model_spec import CHECKPOINT_DTYPES, ModelSpec
from registry_service import metrics
from registry_service.blobs import BlobStore, blob_key
from registry_service.disk_full import SpaceReserve, is_disk_full, storage_full
from registry_service.domain import (
    AdapterSummary,
    AliasChange,
    ByteRange,
    Chunk,
    Event,
    FileInfo,
    GcReport,
    ListFilter,
    Page,
    StoredFile,
    UploadHeader,
    UploadTrailer,
    VersionInfo,
)
from registry_service.download import check_range, stream_files
from registry_service.events import EventFeed
from registry_service.gc import GarbageCollector
from registry_service.paging import PageTokens, page_size
from registry_service.store import BaseModelRecord, BlobsMissing, Store
from registry_service.upload import SpooledFile, UploadSpool, check_header, check_labels
from registry_service.validation import HEAD_BYTES, check_stream_start, validate_adapter
from shared.refs import AdapterRef, validate_alias, validate_name

log = logging.getLogger(__name__)

T = TypeVar("T")

_HEARTBEAT_SECONDS = 30.0
_BLOB_WRITE_ATTEMPTS = 3
_WATCH_BATCH = 500
#: How often a waiting watch stream checks whether its client is still there (thousands may
#: wait: few wake-ups each; a drain wakes them all at once).
_WATCH_WAKE_SECONDS = 5.0
DEFAULT_CHUNK_BYTES = 1024 * 1024
MIN_CHUNK_BYTES = 64 * 1024
MAX_CHUNK_BYTES = 4 * 1024 * 1024
DEFAULT_URL_SECONDS = 900
MAX_URL_SECONDS = 7 * 24 * 3600


@dataclass(frozen=True)
class RegistryLimits:
    max_upload_bytes: int
    max_rank: int
    gc_grace_seconds: int
    #: Piece size of the per-piece sha256s recorded at upload.
    part_size_bytes: int


@dataclass(frozen=True)
class PresignedFile:
    file: FileInfo
    url: str


@dataclass(frozen=True)
class PresignedVersion:
    version: VersionInfo
    files: list[PresignedFile]
    expire_time: datetime


class Registry:
    def __init__(
        self,
        store: Store,
        blobs: BlobStore,
        feed: EventFeed,
        collector: GarbageCollector,
        spool_dir: Path,
        limits: RegistryLimits,
        presign: Callable[[str, int], str] | None = None,
        reserve: SpaceReserve | None = None,
    ) -> None:
        """``presign(blob key, seconds)``: where download URLs come from when not from the
        blob store itself (the blob HTTP server's signed URLs for the local store);
        ``reserve``: space on the data volume that deletes and gc may use when it is full."""
        self.store = store
        self.blobs = blobs
        self.feed = feed
        self.collector = collector
        self.spool_dir = spool_dir
        self.limits = limits
        self._presign = presign or blobs.presign_get
        self.pages = PageTokens(store.server_key("page_tokens"))
        self._reserve = reserve

    # -- base models ---------------------------------------------------------------------------

    def register_base_model(
        self, name: str, spec: ModelSpec, by: str
    ) -> tuple[BaseModelRecord, bool]:
        validate_name(name, "base_model.name")
        if spec.checkpoint_dtype not in CHECKPOINT_DTYPES:
            raise InvalidArgument(
                f"base_model.checkpoint_dtype: {spec.checkpoint_dtype} is not a float type",
                "checkpoint_dtype",
            )
        if not spec.fingerprint.startswith("sha256:") or len(spec.fingerprint) != 71:
            raise InvalidArgument(
                "base_model.fingerprint: expected 'sha256:' + 64 hex digits", "fingerprint"
            )
        record, created = self.store.add_base_model(name, spec, by)
        if created:
            log_event(log, "base_model_registered", name=name, fingerprint=spec.fingerprint, by=by)
        return record, created

    def get_base_model(self, name: str) -> BaseModelRecord:
        return self.store.get_base_model(validate_name(name))

    def list_base_models(self, size: int, token: str) -> Page[BaseModelRecord]:
        limit = page_size(size)
        after = self.pages.decode(token, "base_models", (str,))
        rows = self.store.list_base_models(str(after[0]) if after else None, limit + 1)
        more = len(rows) > limit
        rows = rows[:limit]
        next_token = self.pages.encode([rows[-1].name], "base_models") if more else ""
        return Page(rows, next_token)

    # -- upload --------------------------------------------------------------------------------

    def upload(
        self, header: UploadHeader, chunks: Iterable[Chunk | UploadTrailer], by: str
    ) -> VersionInfo:
        """Receives, validates and stores one adapter version; visible only once
        READY. On any failure the PENDING row becomes FAILED and no blob is
        written unless validation passed."""
        started = time.perf_counter()
        try:
            check_header(header, self.limits.max_upload_bytes)
            pending = self.store.begin_upload(header, by)
        except MoeLoraError as exc:
            metrics.UPLOADS.labels(exc.code.name).inc()
            raise
        try:
            spec = pending.base_model.spec
            with closing(
                UploadSpool(self.spool_dir, header.files, HEAD_BYTES, self.limits.part_size_bytes)
            ) as spool:
                beat = time.monotonic()
                checked_start = False
                for chunk in chunks:
                    if isinstance(chunk, UploadTrailer):
                        spool.expect(chunk)
                        continue
                    spool.write(chunk)
                    if not checked_start:
                        checked_start = self._check_start(spool, header, spec)
                    if time.monotonic() - beat > _HEARTBEAT_SECONDS:
                        self.store.heartbeat(pending.id)
                        beat = time.monotonic()
                files = {f.info.path: f for f in spool.finish()}
                summary = validate_adapter(
                    files[CONFIG_FILE].path, files[WEIGHTS_FILE].path, spec, self.limits.max_rank
                )
                version = self._commit(pending.id, list(files.values()), summary, header.alias)
        except BaseException as exc:
            full = is_disk_full(exc)
            code = exc.code.name if isinstance(exc, MoeLoraError) else "INTERNAL"
            metrics.UPLOADS.labels("RESOURCE_EXHAUSTED" if full else code).inc()
            self._mark_failed(pending.id, header, exc)
            if full:
                raise storage_full() from exc
            raise
        self.feed.notify()
        seconds = time.perf_counter() - started
        metrics.UPLOADS.labels("OK").inc()
        metrics.UPLOAD_BYTES.inc(version.size_bytes)
        log_event(
            log,
            "adapter_uploaded",
            name=version.name,
            version=version.version,
            digest=version.digest,
            bytes=version.size_bytes,
            seconds=round(seconds, 3),
            by=by,
        )
        return version

    def _check_start(self, spool: UploadSpool, header: UploadHeader, spec: ModelSpec) -> bool:
        config, weights = spool.head(CONFIG_FILE), spool.head(WEIGHTS_FILE)
        assert config is not None and weights is not None
        size = next(f.size_bytes for f in header.files if f.path == WEIGHTS_FILE)
        config_bytes = config[0] if config[1] else None
        done = check_stream_start(config_bytes, weights[0], size, spec, self.limits.max_rank)
        if done:
            spool.drop_heads()
        return done

    def _commit(
        self,
        pending_id: int,
        files: list[SpooledFile],
        summary: AdapterSummary,
        alias: str | None,
    ) -> VersionInfo:
        stored = [StoredFile(f.info, blob_key(f.info.sha256)) for f in files]
        digest = files_digest({f.info.path: f.info.sha256 for f in files})
        new = {s.blob_key for s in stored if not self.blobs.exists(s.blob_key)}
        try:
            for attempt in range(1, _BLOB_WRITE_ATTEMPTS + 1):
                # Blobs first: no row ever points at an incomplete object.
                for f in files:
                    self.blobs.put_file(blob_key(f.info.sha256), f.path)
                try:
                    return self.store.complete_upload(
                        pending_id, summary, stored, digest, alias, self._all_present
                    )
                except BlobsMissing as exc:
                    log_event(
                        log, "upload_blob_raced_gc", logging.WARNING, attempt=attempt, keys=str(exc)
                    )
            raise DataLoss("blob store kept losing freshly written blobs (gc with a grace of 0?)")
        except BaseException:
            self._drop_unclaimed(new)
            raise

    def _drop_unclaimed(self, keys: Iterable[str]) -> None:
        """Deletes the blobs a failed upload wrote that no version claimed meanwhile."""
        for key in keys:
            try:
                if not self.store.blob_claimed(key):
                    self.blobs.delete(key)
            except Exception:  # gc finds what is left
                log_event(log, "upload_blob_cleanup_failed", logging.WARNING, exc_info=True)

    def _all_present(self, keys: Iterable[str]) -> bool:
        return all(self.blobs.exists(key) for key in keys)

    def _mark_failed(self, pending_id: int, header: UploadHeader, exc: BaseException) -> None:
        reason = str(exc) or type(exc).__name__
        log_event(
            log,
            "upload_failed",
            logging.WARNING,
            name=header.name,
            base_model=header.base_model,
            error=reason,
        )
        try:
            self.store.fail_upload(pending_id, reason)
        except Exception:
            # gc will find the PENDING row by its stale heartbeat.
            log_event(log, "upload_fail_mark_failed", logging.ERROR, exc_info=True)

    # -- reads ---------------------------------------------------------------------------------

    def get(self, ref: str) -> VersionInfo:
        return self.store.resolve(AdapterRef.parse(ref))

    def list_versions(self, flt: ListFilter, size: int, token: str) -> Page[VersionInfo]:
        if flt.name:
            validate_name(flt.name, "name")
        if flt.base_model:
            validate_name(flt.base_model, "base_model")
        check_labels(flt.labels, "labels")
        limit = page_size(size)
        filters = [
            flt.name,
            flt.base_model,
            sorted(flt.labels.items()),
            flt.include_deleted,
            flt.latest_only,
        ]
        after = self.pages.decode(token, filters, (str, int))
        key = None if after is None else (after[0], after[1])
        rows = self.store.list_versions(flt, key, limit + 1)
        more = len(rows) > limit
        rows = rows[:limit]
        next_token = self.pages.encode([rows[-1].name, rows[-1].version], filters) if more else ""
        return Page(rows, next_token)

    def download(
        self, ref: str, chunk_size: int, byte_range: ByteRange | None = None
    ) -> tuple[VersionInfo, Iterator[Chunk]]:
        """The version and a lazy stream of its files' bytes (or of ``byte_range``), each file
        hashed as it is sent (see registry_service/download.py)."""
        if chunk_size == 0:
            chunk_size = DEFAULT_CHUNK_BYTES
        if not MIN_CHUNK_BYTES <= chunk_size <= MAX_CHUNK_BYTES:
            raise InvalidArgument(
                f"chunk_size: {chunk_size} is outside {MIN_CHUNK_BYTES}-{MAX_CHUNK_BYTES}",
                "chunk_size",
            )
        version, files = self.store.resolve_files(AdapterRef.parse(ref))
        if byte_range is not None:
            byte_range = check_range(byte_range, files)
        return version, stream_files(self.blobs, version, files, chunk_size, byte_range)

    def presign(self, ref: str, expires_in_seconds: int) -> PresignedVersion:
        seconds = expires_in_seconds or DEFAULT_URL_SECONDS
        if not 1 <= seconds <= MAX_URL_SECONDS:
            raise InvalidArgument(
                f"expires_in_seconds: {seconds} is outside 1-{MAX_URL_SECONDS}",
                "expires_in_seconds",
            )
        version, files = self.store.resolve_files(AdapterRef.parse(ref))
        expire_time = self.store.clock() + timedelta(seconds=seconds)
        urls = [PresignedFile(f.info, self._presign(f.blob_key, seconds)) for f in files]
        return PresignedVersion(version, urls, expire_time)

    # -- aliases and deletes -------------------------------------------------------------------

    def set_alias(self, name: str, alias: str, version: int, by: str) -> AliasChange:
        validate_name(name)
        validate_alias(alias)
        if version < 1:
            raise InvalidArgument("version: must be a positive version number", "version")
        change = self.store.set_alias(name, alias, version)
        self.feed.notify()
        log_event(
            log,
            "alias_set",
            name=name,
            alias=alias,
            version=version,
            previous_version=change.previous_version,
            by=by,
        )
        return change

    def delete_alias(self, name: str, alias: str, by: str) -> int:
        validate_name(name)
        validate_alias(alias)
        previous = self.store.delete_alias(name, alias)
        self.feed.notify()
        log_event(log, "alias_deleted", name=name, alias=alias, version=previous, by=by)
        return previous

    def _freeing(self, work: Callable[[], T]) -> T:
        """Runs ``work`` (which frees space). On a full volume it makes room and tries again:
        first the reserve is given up, then SQLite's write-ahead log is moved into the database
        (its file's space is then reused); RESOURCE_EXHAUSTED when neither helps."""
        reserve_given = self._reserve is None
        while True:
            try:
                return work()
            except Exception as exc:
                if not is_disk_full(exc):
                    raise
                failure = exc
            if not reserve_given:
                reserve_given = True
                if self._reserve is not None and self._reserve.release():
                    continue
            if not self._give_back_space():
                raise storage_full() from failure

    def _give_back_space(self) -> bool:
        """Checkpoints SQLite's write-ahead log; False when the volume is too full for it."""
        try:
            self.store.db.give_back_space()
        except Exception as exc:
            if not is_disk_full(exc):
                raise
            log_event(log, "wal_checkpoint_deferred", logging.WARNING, reason="disk full")
            return False
        return True

    def delete(self, ref: str, by: str, refuse_if_aliased: bool = False) -> VersionInfo:
        parsed = AdapterRef.parse(ref)
        version, changed = self._freeing(
            lambda: self.store.delete_version(parsed, refuse_if_aliased)
        )
        if changed:
            self.feed.notify()
            log_event(
                log,
                "adapter_deleted",
                name=version.name,
                version=version.version,
                digest=version.digest,
                by=by,
            )
        return version

    # -- watch ---------------------------------------------------------------------------------

    def watch_start(self, after_sequence: int, name: str, base_model: str) -> int:
        """Checks a watch's filters; the sequence it resumes after. OutOfRange when
        events after ``after_sequence`` are no longer all kept."""
        if name:
            validate_name(name, "name")
        if base_model:
            validate_name(base_model, "base_model")
        if after_sequence == 0:
            return self.feed.latest  # what the feed has seen: no query per watch opened
        latest = self.store.last_sequence()
        if after_sequence > latest:
            raise OutOfRange(
                f"after_sequence {after_sequence} is beyond the newest event {latest} (was the "
                "registry database replaced?): re-list, then watch from 0"
            )
        oldest = self.store.oldest_sequence()
        first_kept = latest + 1 if oldest is None else oldest
        if after_sequence + 1 < first_kept:
            raise OutOfRange(
                f"after_sequence {after_sequence}: events before {first_kept} are no longer "
                "kept; re-list, then watch from 0"
            )
        return after_sequence

    def watch(
        self, after: int, name: str, base_model: str, stop: Callable[[], bool]
    ) -> Iterator[Event]:
        """Events after ``after`` matching the filters, as they are committed,
        until ``stop()`` says so. ``after`` comes from ``watch_start``."""
        cursor = after
        while not stop():
            newest = self.feed.wait_beyond(cursor, _WATCH_WAKE_SECONDS)
            if newest <= cursor:
                continue
            kept = self.feed.recent(cursor, newest)
            if kept is not None:  # read once for every stream
                yield from (e for e in kept if e.matches(name, base_model))
                cursor = newest
                continue
            batch = self.store.events(cursor, newest, name, base_model, _WATCH_BATCH)
            yield from batch
            cursor = batch[-1].sequence if len(batch) == _WATCH_BATCH else newest

    # -- gc ------------------------------------------------------------------------------------

    def gc(self, grace_seconds: int | None, dry_run: bool) -> GcReport:
        grace = self.limits.gc_grace_seconds if grace_seconds is None else grace_seconds
        if grace < 0:
            raise InvalidArgument("grace_seconds: must not be negative", "grace_seconds")
        report = self._freeing(lambda: self.collector.collect(grace, dry_run))
        if not dry_run:
            self._give_back_space()
            if self._reserve is not None:
                self._reserve.ensure()
        if not dry_run:
            metrics.GC_REMOVED_BLOBS.inc(len(report.removed_blobs))
            metrics.GC_REMOVED_BYTES.inc(report.removed_bytes)
        return report
