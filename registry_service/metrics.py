"""The registry's Prometheus metrics (RPC counts and latencies come from
shared/rpc_metrics.py)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from moelora.client.logs import log_event

if TYPE_CHECKING:  # the store's engine counts database errors here: no import at run time
    from registry_service.store import Inventory

log = logging.getLogger(__name__)

UPLOADS = Counter(
    "moelora_registry_uploads_total",
    "Adapter uploads by outcome (OK or the gRPC status code of the failure)",
    ["code"],
)
UPLOADS.labels("OK")
UPLOAD_BYTES = Counter(
    "moelora_registry_upload_bytes_total", "Bytes of adapter files stored by successful uploads"
)
DOWNLOAD_BYTES = Counter(
    "moelora_registry_download_bytes_total", "Adapter bytes sent by DownloadAdapter"
)
DATA_LOSS = Counter(
    "moelora_registry_checksum_failures_total", "Stored blobs whose bytes failed their sha256"
)
WATCH_STREAMS = Gauge("moelora_registry_watch_streams", "Open WatchAdapters streams")
GC_REMOVED_BLOBS = Counter("moelora_registry_gc_removed_blobs_total", "Blobs removed by gc")
GC_REMOVED_BYTES = Counter("moelora_registry_gc_removed_bytes_total", "Bytes removed by gc")
DATABASE_ERRORS = Counter(
    "moelora_registry_database_errors_total",
    "Database operations that failed (connection lost, timeout, refused statement); "
    "transactions retried after losing a race to another writer are not counted",
)
BLOB_STORE_ERRORS = Counter(
    "moelora_registry_blob_store_errors_total",
    "Object-store (S3) requests that failed after their retries",
)

#: Scrapes read the inventory from the database at most this often (several scrapers, or one
#: scraping fast, cost the database no more).
INVENTORY_MAX_AGE_SECONDS = 5.0


class InventoryCollector(Collector):
    """``moelora_registry_base_models``, ``moelora_registry_adapters`` and
    ``moelora_registry_versions`` / ``moelora_registry_version_bytes`` by status, read from
    the database when scraped (at most every INVENTORY_MAX_AGE_SECONDS, however many
    scrapers). A database that cannot answer counts a database error and leaves the series
    out of that scrape."""

    def __init__(
        self, read: Callable[[], Inventory], max_age: float = INVENTORY_MAX_AGE_SECONDS
    ) -> None:
        self._read = read
        self._max_age = max_age
        self._lock = threading.Lock()
        self._taken = -float("inf")
        self._last: Inventory | None = None

    def _inventory(self) -> Inventory | None:
        with self._lock:
            if time.monotonic() - self._taken >= self._max_age:
                try:
                    self._last = self._read()
                except Exception as exc:  # the scrape must not fail: say it, count it
                    log_event(log, "inventory_failed", logging.WARNING, error=str(exc))
                    DATABASE_ERRORS.inc()
                    self._last = None
                self._taken = time.monotonic()
            return self._last

    def describe(self) -> Iterator[Metric]:
        """The names, without reading the database (registration calls this)."""
        return self._families(None)

    def collect(self) -> Iterator[Metric]:
        inventory = self._inventory()
        if inventory is None:
            return iter(())
        return self._families(inventory)

    def _families(self, inventory: Inventory | None) -> Iterator[Metric]:
        if inventory is None:
            yield GaugeMetricFamily("moelora_registry_base_models", "")
            yield GaugeMetricFamily("moelora_registry_adapters", "")
            yield GaugeMetricFamily("moelora_registry_versions", "", labels=["status"])
            yield GaugeMetricFamily("moelora_registry_version_bytes", "", labels=["status"])
            return
        yield GaugeMetricFamily(
            "moelora_registry_base_models", "Registered base models", value=inventory.base_models
        )
        yield GaugeMetricFamily(
            "moelora_registry_adapters",
            "Adapter names with at least one READY version",
            value=inventory.adapters,
        )
        versions = GaugeMetricFamily(
            "moelora_registry_versions", "Adapter versions by status", labels=["status"]
        )
        sizes = GaugeMetricFamily(
            "moelora_registry_version_bytes",
            "Bytes of the adapter versions' files, by status",
            labels=["status"],
        )
        for status, count in inventory.versions.items():
            versions.add_metric([status.value], count)
            sizes.add_metric([status.value], inventory.version_bytes[status])
        yield versions
        yield sizes
