#!/usr/bin/env python3
"""Copies a base-model checkpoint from S3 into a local folder (the executor's init container).

    fetch_model.py s3://BUCKET/PREFIX DEST

Every object under PREFIX lands at DEST/<key without PREFIX>. Each file is written to
a ``.part`` name and renamed when complete, so an interrupted copy never leaves a file
that looks whole. DEST/.fetch-manifest.json records each file's size and ETag: a
restarted pod whose DEST is a persistent volume downloads only what changed.
Connection settings are the registry's: MOELORA_REGISTRY_S3_ENDPOINT_URL,
MOELORA_REGISTRY_S3_REGION, MOELORA_REGISTRY_S3_PATH_STYLE; credentials come from boto3's
chain (AWS_* variables, web identity, instance profile). Ships in the registry image,
which has boto3.

Exit codes: 0 copied, 1 S3 or file error, 2 bad usage or nothing under PREFIX.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.client import Config
from botocore.exceptions import BotoCoreError, ClientError

MANIFEST = ".fetch-manifest.json"
TRUE_WORDS = ("1", "true", "yes", "on")


@dataclass(frozen=True)
class RemoteFile:
    key: str
    relative: str
    size: int
    etag: str


@dataclass(frozen=True)
class Source:
    bucket: str
    prefix: str

    @classmethod
    def parse(cls, url: str) -> Source:
        if not url.startswith("s3://"):
            raise ValueError(f"source: {url!r} is not s3://BUCKET[/PREFIX]")
        bucket, _, prefix = url[len("s3://") :].partition("/")
        if not bucket:
            raise ValueError(f"source: {url!r} names no bucket")
        # A prefix names a folder: "models/x" must not also match "models/x-old/...".
        if prefix and not prefix.endswith("/"):
            prefix += "/"
        return cls(bucket, prefix)


def relative_path(key: str, prefix: str) -> str:
    """The key below the prefix as a safe relative path; refuses keys that would
    escape DEST."""
    relative = key[len(prefix) :]
    parts = PurePosixPath(relative).parts
    if not parts or relative.startswith("/") or any(p in ("..", ".") for p in parts):
        raise ValueError(f"object key {key!r} does not map to a file below the destination")
    return relative


def list_files(client: Any, source: Source) -> Iterator[RemoteFile]:
    paginator = client.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=source.bucket, Prefix=source.prefix):
        for obj in page.get("Contents", []):
            key = obj["Key"]
            if key.endswith("/"):  # folder marker objects some tools create
                continue
            yield RemoteFile(
                key, relative_path(key, source.prefix), int(obj["Size"]), str(obj["ETag"])
            )


def read_manifest(dest: Path) -> dict[str, dict[str, Any]]:
    try:
        loaded = json.loads((dest / MANIFEST).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
    return loaded if isinstance(loaded, dict) else {}


def write_atomically(path: Path, text: str) -> None:
    part = path.with_name(path.name + ".part")
    part.write_text(text)
    part.replace(path)


def is_current(dest: Path, remote: RemoteFile, manifest: dict[str, dict[str, Any]]) -> bool:
    local = dest / remote.relative
    entry = manifest.get(remote.relative)
    return (
        local.is_file()
        and local.stat().st_size == remote.size
        and entry == {"size": remote.size, "etag": remote.etag}
    )


def fetch(client: Any, source: Source, dest: Path) -> dict[str, int]:
    """Copies every file that is missing or changed; returns counts for the log line."""
    remote_files = list(list_files(client, source))
    if not remote_files:
        raise LookupError(f"no objects under s3://{source.bucket}/{source.prefix}")
    manifest = read_manifest(dest)
    transfer = TransferConfig(multipart_chunksize=64 * 1024**2, max_concurrency=8)
    fetched = fetched_bytes = 0
    for remote in remote_files:
        if is_current(dest, remote, manifest):
            continue
        local = dest / remote.relative
        local.parent.mkdir(parents=True, exist_ok=True)
        part = local.with_name(local.name + ".part")
        client.download_file(source.bucket, remote.key, str(part), Config=transfer)
        if part.stat().st_size != remote.size:
            raise OSError(f"{remote.key}: got {part.stat().st_size} bytes, expected {remote.size}")
        part.replace(local)
        manifest[remote.relative] = {"size": remote.size, "etag": remote.etag}
        # Written after every file, so a restart resumes instead of starting over.
        write_atomically(dest / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
        fetched += 1
        fetched_bytes += remote.size
    return {"files": len(remote_files), "fetched": fetched, "fetched_bytes": fetched_bytes}


def make_client(environ: dict[str, str]) -> Any:
    path_style = environ.get("MOELORA_REGISTRY_S3_PATH_STYLE", "").lower() in TRUE_WORDS
    return boto3.client(
        "s3",
        endpoint_url=environ.get("MOELORA_REGISTRY_S3_ENDPOINT_URL") or None,
        region_name=environ.get("MOELORA_REGISTRY_S3_REGION") or None,
        config=Config(
            s3={"addressing_style": "path" if path_style else "auto"},
            retries={"max_attempts": 10, "mode": "adaptive"},
        ),
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", help="s3://BUCKET/PREFIX of the checkpoint folder")
    parser.add_argument("dest", type=Path, help="local folder to fill")
    args = parser.parse_args(argv)
    try:
        source = Source.parse(args.source)
    except ValueError as exc:
        parser.error(str(exc))
    start = time.monotonic()
    args.dest.mkdir(parents=True, exist_ok=True)
    try:
        counts = fetch(make_client(dict(os.environ)), source, args.dest)
    except LookupError as exc:
        print(f"fetch_model: {exc}", file=sys.stderr)
        return 2
    except (BotoCoreError, ClientError, OSError, ValueError) as exc:
        print(f"fetch_model: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    line = {"event": "model_fetched", "source": args.source, "dest": str(args.dest), **counts}
    line["seconds"] = round(time.monotonic() - start, 3)
    print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
