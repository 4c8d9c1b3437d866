"""Where adapters come from: pluggable sources that resolve a reference and fetch the files.

A source does two things, the same two a registry client does:

* ``resolve(ref)`` turns ``name``, ``name:V``, ``name@alias`` or ``name@sha256:HEX`` into one
  immutable version ``ResolvedAdapter(name, version, digest)``. The executor keys everything it
  holds by the digest, so an alias that moves or a newer version makes a new entry, never a
  stale hit.
* ``fetch(adapter)`` returns that version's files, checked against the digest.

``LocalFolderSource`` serves a folder of adapters; ``RegistrySource`` (registry_source.py)
implements the same protocol over gRPC and also fills ``base_model_fingerprint``.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from executor_service.packer import Arriving
from moelora.client.adapter_files import (
    ADAPTER_FILES,
    CONFIG_FILE,
    WEIGHTS_FILE,
    digest_of_files,
    files_digest,
)
from moelora.client.errors import DataLoss, FailedPrecondition, NotFound
from shared.refs import AdapterRef


@dataclass(frozen=True)
class ResolvedAdapter:
    """One immutable adapter version."""

    name: str
    version: int
    digest: str
    #: Fingerprint of the base model the source validated it against; None when the source
    #: does not know (a local folder), in which case packing against the base model decides.
    base_model_fingerprint: str | None = None
    #: The adapter's packed LoRA rank where the source recorded it (the registry does), so
    #: that an adapter no slot can hold is refused before its download.
    rank: int | None = field(default=None, compare=False)

    @property
    def label(self) -> str:
        """``name:VERSION``, as responses and metrics name it."""
        return f"{self.name}:{self.version}"


def _nothing() -> None:
    pass


@dataclass(frozen=True)
class AdapterFiles:
    """The files of one adapter version, as the packer takes them: the weights in memory, a
    checked file on disk that the packer memory-maps, or a file still being downloaded
    (``Arriving``) that the packer reads range by range as it arrives. ``finish`` returns once
    the files were checked against the digest (DataLoss if not): nothing made from the weights
    may be published before. ``close`` lets go of a download (finished or abandoned)."""

    config: Mapping[str, Any]
    weights: bytes | Path | Arriving
    finish: Callable[[], None] = _nothing
    close: Callable[[], None] = _nothing


class AdapterSource(Protocol):
    """Resolves references and fetches adapter files.

    Errors: NotFound (no such adapter, version, alias or digest), Unavailable (the source
    cannot be reached: retry), DataLoss (fetched bytes do not match the digest),
    FailedPrecondition (the stored adapter is unusable, for example a missing file).
    """

    def resolve(self, ref: AdapterRef) -> ResolvedAdapter: ...

    def resolve_at_once(self, ref: AdapterRef) -> ResolvedAdapter | None:
        """``resolve``'s answer when giving it waits on nothing (no network, no reading of
        files), else None. The engine's launch thread asks this, and leaves a request that
        gets None to threads that may wait. Errors as ``resolve``."""
        ...

    def fetch(self, adapter: ResolvedAdapter) -> AdapterFiles: ...

    def cached(self) -> list[ResolvedAdapter]:
        """Versions the source keeps on local disk, so fetching them needs no network
        (ListLoadedAdapters reports them as DISK)."""
        ...

    def close(self) -> None:
        """Releases what the source holds open (connections); the executor is stopping."""
        ...


def checked_files(adapter: ResolvedAdapter, data: Mapping[str, bytes], where: str) -> AdapterFiles:
    """The fetched bytes of ``adapter`` as the packer takes them, after checking them against
    its digest (DataLoss) and that the config is a JSON object (FailedPrecondition)."""
    check_digest(adapter, digest_of_files(data), where)
    return AdapterFiles(
        config=parse_config(adapter, data[CONFIG_FILE], where), weights=data[WEIGHTS_FILE]
    )


def check_digest(adapter: ResolvedAdapter, digest: str, where: str) -> None:
    """DataLoss unless the files from ``where`` (whose version digest is ``digest``) are
    ``adapter``'s."""
    if digest != adapter.digest:
        raise DataLoss(
            f"adapter {adapter.label}: the files from {where} have digest {digest}, "
            f"expected {adapter.digest}"
        )


def parse_config(adapter: ResolvedAdapter, raw: bytes, where: str) -> Mapping[str, Any]:
    """The adapter's config, which must be a JSON object (FailedPrecondition)."""
    try:
        config = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FailedPrecondition(
            f"adapter {adapter.label}: {CONFIG_FILE} from {where} is not valid JSON: {exc}"
        ) from None
    if not isinstance(config, dict):
        raise FailedPrecondition(
            f"adapter {adapter.label}: {CONFIG_FILE} from {where} must hold a JSON object"
        )
    return config


@dataclass(frozen=True)
class _FileStamp:
    size: int
    mtime_ns: int


class LocalFolderSource:
    """Adapters in a local folder: ``ROOT/NAME/`` holds either the files themselves
    (``adapter_config.json`` and ``adapter_model.safetensors``; that is version 1) or
    numbered version folders ``ROOT/NAME/1/``, ``ROOT/NAME/2/``, ... A bare name resolves
    to the highest version. Local folders have no aliases.

    File hashes are remembered by (size, mtime) so that resolving a bare name does not
    re-read the weights. ``resolve`` looks at the folder every time; ``resolve_at_once`` (the
    launch loop's, once per request) trusts its last answer for ``recheck_seconds``: a file
    changed or a version added is seen within that long."""

    def __init__(self, root: Path, recheck_seconds: float = 1.0) -> None:
        self.root = root
        self.recheck_seconds = recheck_seconds
        self._lock = threading.Lock()
        self._hashes: dict[Path, tuple[_FileStamp, str]] = {}
        #: str(ref) -> (time.monotonic() when looked at, the answer then).
        self._recent: dict[str, tuple[float, ResolvedAdapter]] = {}

    def resolve(self, ref: AdapterRef) -> ResolvedAdapter:
        resolved = self._resolve(ref, at_once=False)
        assert resolved is not None
        self._recent[str(ref)] = (time.monotonic(), resolved)
        return resolved

    def resolve_at_once(self, ref: AdapterRef) -> ResolvedAdapter | None:
        """The answer of the last ``recheck_seconds``, else the folder's if its files'
        hashes are known; None until they have been hashed (by ``resolve``)."""
        key = str(ref)
        now = time.monotonic()
        recent = self._recent.get(key)
        if recent is not None and now - recent[0] < self.recheck_seconds:
            return recent[1]
        resolved = self._resolve(ref, at_once=True)
        if resolved is not None:
            self._recent[key] = (now, resolved)
        return resolved

    def _resolve(self, ref: AdapterRef, at_once: bool) -> ResolvedAdapter | None:
        versions = self._versions(ref.name)
        if ref.alias is not None:
            raise NotFound(
                f"adapter {ref}: the local adapter folder {self.root} has no aliases; "
                f"use {ref.name} or {ref.name}:VERSION"
            )
        if ref.version is not None:
            if ref.version not in versions:
                raise NotFound(
                    f"adapter {ref}: no version {ref.version} in {self.root / ref.name} "
                    f"(versions: {sorted(versions)})"
                )
            return self._resolved(ref.name, ref.version, versions[ref.version], at_once)
        if ref.digest is not None:
            for version, folder in sorted(versions.items()):
                resolved = self._resolved(ref.name, version, folder, at_once)
                if resolved is None:
                    return None
                if resolved.digest == ref.digest:
                    return resolved
            raise NotFound(f"adapter {ref}: no version of {ref.name} has that digest")
        newest = max(versions)
        return self._resolved(ref.name, newest, versions[newest], at_once)

    def fetch(self, adapter: ResolvedAdapter) -> AdapterFiles:
        folder = self._versions(adapter.name).get(adapter.version)
        if folder is None:
            raise NotFound(f"adapter {adapter.label} is gone from {self.root}")
        data = {name: self._read(folder / name) for name in ADAPTER_FILES}
        return checked_files(adapter, data, where=str(folder))

    def cached(self) -> list[ResolvedAdapter]:
        return []  # the folder is the adapters' home, not a cache of them

    def close(self) -> None:
        pass  # holds nothing open

    def _versions(self, name: str) -> dict[int, Path]:
        # ``name`` passed validate_name (AdapterRef.parse), so it cannot leave the root.
        folder = self.root / name
        if not folder.is_dir():
            raise NotFound(f"adapter {name!r} not found in the local adapter folder {self.root}")
        if (folder / CONFIG_FILE).exists():
            return {1: folder}
        versions = {
            int(child.name): child
            for child in folder.iterdir()
            if child.name.isascii()
            and child.name.isdigit()
            and int(child.name) >= 1
            and child.is_dir()
        }
        if not versions:
            raise NotFound(
                f"adapter {name!r}: {folder} holds neither {CONFIG_FILE} nor numbered version "
                "folders"
            )
        return versions

    def _resolved(
        self, name: str, version: int, folder: Path, at_once: bool
    ) -> ResolvedAdapter | None:
        hashes = {}
        for file in ADAPTER_FILES:
            sha = self._sha256(folder / file, at_once)
            if sha is None:
                return None
            hashes[file] = sha
        return ResolvedAdapter(name=name, version=version, digest=files_digest(hashes))

    def _sha256(self, path: Path, at_once: bool) -> str | None:
        """The file's hash (None if at_once and it would have to be read)."""
        try:
            stat = path.stat()
        except FileNotFoundError:
            raise FailedPrecondition(f"adapter folder {path.parent} lacks {path.name}") from None
        stamp = _FileStamp(stat.st_size, stat.st_mtime_ns)
        with self._lock:
            known = self._hashes.get(path)
        if known is not None and known[0] == stamp:
            return known[1]
        if at_once:
            return None
        sha = hashlib.sha256(self._read(path)).hexdigest()
        with self._lock:
            self._hashes[path] = (stamp, sha)
        return sha

    @staticmethod
    def _read(path: Path) -> bytes:
        try:
            return path.read_bytes()
        except FileNotFoundError:
            raise FailedPrecondition(f"adapter folder {path.parent} lacks {path.name}") from None
