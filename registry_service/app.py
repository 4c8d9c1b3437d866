"""Where the registry's parts are assembled from its settings: database
(migrated or checked), blob store, event feed, gc, auth."""

from __future__ import annotations

import logging
import ssl
from dataclasses import dataclass

from moelora.client.logs import log_event
from registry_service.blob_http import BlobHttpServer, HttpLimits
from registry_service.blobs import BlobStore, open_blob_store
from registry_service.blobs.local import LocalBlobStore
from registry_service.config import RegistrySettings
from registry_service.db import migrate
from registry_service.db.engine import Database, sqlite_url
from registry_service.disk_full import SpaceReserve
from registry_service.events import KEEP, EventFeed
from registry_service.gc import GarbageCollector, PeriodicGc
from registry_service.service import Registry, RegistryLimits
from registry_service.store import Store
from registry_service.url_signing import UrlSigner
from shared.tokens import TokenChecker, open_token_checker

log = logging.getLogger(__name__)

#: Space on the data volume held for deletes and gc when it fills (a few SQLite pages and its
#: write-ahead log).
_RESERVE_BYTES = 1024 * 1024
#: At most this long a closing blob HTTP server waits for transfers in progress.
_HTTP_CLOSE_SECONDS = 5.0


def open_database(settings: RegistrySettings) -> Database:
    return Database(settings.database_url or sqlite_url(settings.data_path / "registry.db"))


def open_blobs(settings: RegistrySettings) -> BlobStore:
    return open_blob_store(
        settings.blob_url,
        settings.data_path,
        s3_endpoint_url=settings.s3_endpoint_url,
        s3_region=settings.s3_region,
        s3_path_style=settings.s3_path_style,
        s3_part_bytes=settings.s3_part_bytes,
        s3_max_attempts=settings.s3_max_attempts,
        s3_timeout_seconds=settings.s3_timeout_seconds,
    )


def open_authorizer(settings: RegistrySettings) -> TokenChecker:
    """Auth as the settings ask: ``auto`` is off only in the embedded mode (loopback, SQLite
    and blobs in data_dir); refuses auth without a token file."""
    return open_token_checker(
        settings.auth,
        settings.listen,
        settings.auth_tokens_file,
        local=settings.embedded_storage,
        hint="adapterctl --token or MOELORA_REGISTRY_TOKEN",
        auto_on_when="outside the embedded mode",
    )


def open_blob_http(settings: RegistrySettings, blobs: BlobStore) -> BlobHttpServer | None:
    """The blob HTTP server (bound, not started) when the settings ask for one and the blobs
    are local: S3 serves its own presigned URLs."""
    if not settings.http_listen or not isinstance(blobs, LocalBlobStore):
        return None
    signer = (
        UrlSigner.from_file(settings.http_signing_key_file)
        if settings.http_signing_key_file is not None
        else UrlSigner.random()
    )
    tls = None
    if settings.tls_cert_file is not None and settings.tls_key_file is not None:
        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        tls.load_cert_chain(settings.tls_cert_file, settings.tls_key_file)
    return BlobHttpServer(
        settings.http_listen,
        blobs,
        signer,
        public_url=settings.http_public_url,
        tls=tls,
        # Transfers ran on through the gRPC drain before this closes; a few more seconds, not
        # a second drain (the pod's termination grace counts one drain).
        grace_seconds=min(settings.drain_seconds, _HTTP_CLOSE_SECONDS),
        limits=HttpLimits(
            max_connections=settings.http_max_connections,
            head_seconds=settings.http_timeout_seconds,
        ),
    )


@dataclass
class RegistryApp:
    registry: Registry
    authorizer: TokenChecker
    db: Database
    feed: EventFeed
    periodic_gc: PeriodicGc | None = None
    blob_http: BlobHttpServer | None = None

    def close(self) -> None:
        if self.blob_http is not None:
            self.blob_http.close()
        if self.periodic_gc is not None:
            self.periodic_gc.stop()
        self.feed.stop()
        self.db.dispose()


def open_registry(settings: RegistrySettings, *, background: bool = True) -> RegistryApp:
    """The registry's parts; ``background``: start the event feed and the periodic gc (a
    server does, a one-off command does not)."""
    authorizer = open_authorizer(settings)
    db = open_database(settings)
    if settings.migrate_on_start:
        migrate.upgrade(db)
    else:
        migrate.require_current(db)
    blobs = open_blobs(settings)
    store = Store(db)
    feed = EventFeed(
        store.last_sequence,
        settings.watch_poll_seconds,
        lambda after, upto: store.events(after, upto, "", "", KEEP),
    )
    spool_dir = settings.data_path / "spool"
    collector = GarbageCollector(db, blobs, spool_dir, settings.event_retention_seconds)
    limits = RegistryLimits(
        max_upload_bytes=settings.max_upload_bytes,
        max_rank=settings.max_rank,
        gc_grace_seconds=settings.gc_grace_seconds,
        part_size_bytes=settings.part_size_bytes,
    )
    blob_http = open_blob_http(settings, blobs) if background else None
    presign = blob_http.urls.url if blob_http is not None else None
    # Deletes and gc must work when the data volume is full: SQLite writes to delete anything.
    reserve = SpaceReserve(settings.data_path / "space-reserve", _RESERVE_BYTES)
    reserve.ensure()
    registry = Registry(store, blobs, feed, collector, spool_dir, limits, presign, reserve)
    periodic_gc = None
    if background:
        if blob_http is not None:
            blob_http.start()
        feed.start()
        if settings.gc_interval_seconds > 0:
            periodic_gc = PeriodicGc(lambda: registry.gc(None, False), settings.gc_interval_seconds)
            periodic_gc.start()
    log_event(
        log,
        "registry_opened",
        database=db.safe_url,
        blobs=blobs.location,
        auth="on" if authorizer.enabled else "off",
        max_rank=settings.max_rank,
        blob_urls=blob_http.urls.base_url if blob_http is not None else None,
    )
    return RegistryApp(registry, authorizer, db, feed, periodic_gc, blob_http)
