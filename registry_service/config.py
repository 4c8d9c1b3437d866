"""Registry settings: each field is a flag and a MOELORA_REGISTRY_* environment variable."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from moelora.client.part_digests import MIB
from shared.config import ServerSettings

DEFAULT_DATA_DIR = Path("~/.moelora/registry")


class RegistrySettings(ServerSettings):
    """The embedded defaults run a complete registry on one machine: SQLite and a
    local blob directory under ``data_dir``, on 127.0.0.1, without auth."""

    model_config = SettingsConfigDict(env_prefix="MOELORA_REGISTRY_")
    prog_name: ClassVar[str] = "moelora-registry"

    listen: str = Field("127.0.0.1:50051", description="host:port the gRPC server listens on")
    data_dir: Path = Field(
        DEFAULT_DATA_DIR,
        description="folder for the embedded SQLite database and blob store",
    )
    database_url: str | None = Field(
        None,
        description="SQLAlchemy URL (sqlite:///PATH or postgresql+psycopg://...); "
        "default: SQLite in data_dir",
    )
    blob_url: str | None = Field(
        None,
        description="where adapter weights go: file:///PATH or s3://BUCKET[/PREFIX]; "
        "default: data_dir/blobs",
    )
    s3_endpoint_url: str | None = Field(
        None, description="S3 endpoint for MinIO/R2/Ceph; default: AWS"
    )
    s3_region: str | None = Field(None, description="S3 region")
    s3_path_style: bool = Field(False, description="use path-style S3 addressing")
    s3_part_bytes: int = Field(
        64 * 1024**2,
        ge=5 * 1024**2,
        le=5 * 1024**3,
        description="S3 multipart upload part size; smaller objects go up in one request",
    )
    s3_max_attempts: int = Field(
        8,
        ge=1,
        le=20,
        description="attempts of each S3 request (backoff between them) before the RPC "
        "answers UNAVAILABLE",
    )
    s3_timeout_seconds: float = Field(
        120.0,
        gt=0,
        description="how long one S3 request may wait for the server (a stalled store fails "
        "the attempt rather than the RPC hanging)",
    )
    auth: Literal["auto", "on", "off"] = Field(
        "auto",
        description="bearer-token auth: auto = on unless listening on loopback in embedded mode",
    )
    auth_tokens_file: Path | None = Field(
        None, description="JSON file of hashed tokens with roles (see docs/registry.md)"
    )
    max_upload_bytes: int = Field(
        8 * 1024**3, ge=1, description="largest file one upload may carry, in bytes"
    )
    part_size_bytes: int = Field(
        16 * MIB,
        ge=MIB,
        multiple_of=MIB,
        description="piece size of the per-piece sha256s recorded at upload "
        "(AdapterFile.part_sha256), which downloaders check in parallel; a positive "
        "multiple of 1 MiB; versions keep the size they were uploaded with",
    )
    gc_interval_seconds: float = Field(
        3600.0,
        ge=0,
        description="run gc (with gc_grace_seconds) this often in the server, so that what "
        "crashes leave behind goes without an operator; 0: only on request",
    )
    gc_grace_seconds: int = Field(
        3600, ge=0, description="unreferenced blobs younger than this survive gc"
    )
    max_rank: int = Field(
        256,
        ge=1,
        description="largest LoRA rank an upload may have (packed: a per-expert adapter's "
        "gate and up ranks add up)",
    )
    event_retention_seconds: int = Field(
        7 * 24 * 3600, ge=0, description="gc prunes change events older than this"
    )
    watch_poll_seconds: float = Field(
        0.5, gt=0, description="how often WatchAdapters streams look for other replicas' events"
    )
    max_watch_streams: int = Field(
        4096,
        ge=2,
        description="WatchAdapters streams served at once, each on a thread of its own (not a "
        "worker's); more: RESOURCE_EXHAUSTED. Readers other than the executor fleet's token "
        "(fleet in the token file) may hold half of them",
    )
    max_watch_streams_per_token: int = Field(
        16,
        ge=1,
        description="WatchAdapters streams one token may hold at once, the executor fleet's "
        "token excepted; more: RESOURCE_EXHAUSTED",
    )
    max_workers: int = Field(64, ge=4, description="gRPC worker threads (watches apart)")
    migrate_on_start: bool = Field(True, description="run Alembic migrations at start-up")
    metrics_listen: str = Field(
        "127.0.0.1:9401", description="host:port of the Prometheus /metrics endpoint; empty: off"
    )
    max_message_bytes: int = Field(
        16 * 1024 * 1024, ge=4 * 1024 * 1024, description="largest gRPC message in bytes"
    )
    http_listen: str = Field(
        "127.0.0.1:50053",
        description="host:port of the blob HTTP server, which makes GetDownloadUrls work for "
        "the local-directory blob store: signed, expiring URLs read with HTTP Range GETs "
        "(sendfile; no gRPC on the byte path); empty: off (S3 presigns its own URLs)",
    )
    http_public_url: str = Field(
        "",
        description="base URL the signed blob URLs carry, i.e. how executors reach the blob "
        "HTTP server (in Kubernetes: http://SERVICE:PORT); default: the http_listen address "
        "(a wildcard host becomes this host's name); https when TLS is on",
    )
    http_max_connections: int = Field(
        512,
        ge=1,
        description="connections the blob HTTP server keeps open at once (each costs a file "
        "descriptor, no thread); more are answered 503 with Retry-After and closed",
    )
    http_timeout_seconds: float = Field(
        10.0,
        gt=0,
        description="blob HTTP: a request head must be complete this long after its first "
        "byte (a trickle does not extend it), and a response must be taken at 256 KiB/s after "
        "this long a start; a connection past either is closed",
    )
    http_signing_key_file: Path | None = Field(
        None,
        description="file whose bytes (16 or more) sign the blob URLs; replicas serving one "
        "blob directory share it; default: a random key per process",
    )

    @property
    def data_path(self) -> Path:
        return self.data_dir.expanduser()

    @property
    def embedded_storage(self) -> bool:
        """SQLite and blobs under data_dir: the single-machine mode."""
        return self.database_url is None and self.blob_url is None
