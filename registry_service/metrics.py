"""The registry's Prometheus metrics (RPC counts and latencies come from
shared/grpc_server.py)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

UPLOADS = Counter(
    "moelora_registry_uploads_total",
    "Adapter uploads by outcome (OK or the gRPC status code of the failure)",
    ["code"],
)
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
