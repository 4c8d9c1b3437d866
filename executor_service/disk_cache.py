"""The local disk cache of downloaded adapter versions, under the host-memory cache.

Each version is a folder ``ROOT/<digest hex>/`` holding its files and ``version.json`` (its
name, number and digest, for ListLoadedAdapters), keyed by digest so that it is immutable. An
entry is written under a temporary name and renamed into place complete, so a crash never
leaves a half entry that looks whole. A byte budget bounds the cache; the least recently used
versions go first. Entries survive restarts: a restarted executor serves what it had
downloaded even while the registry is unreachable. An entry is checked against its digest
once per process (at commit, since the download checked the bytes as they arrived; after a
restart, at its first read), and then served while its files keep the size and mtime seen
then: a replaced or truncated file is hashed again, and a damaged entry is dropped and fetched
again rather than served. Reads hand out the folder, for the packer to memory-map.

With the entry, ``files.json`` keeps what the registry listed of its files (sha256 and piece
digests) when the version had pieces: a restarted executor then checks the files piece by
piece on ``check_threads`` threads, bound to the digest through the listed sha256s, instead of
hashing each file whole on one core (1.26 GB: about a second at 1.3 GB/s).

``references.json`` beside the entries keeps what moving references (a bare name, an alias)
last resolved to, for the versions held, so that an executor restarted while the registry is
down still serves ``name@prod`` from the entry it pointed at; ``name:VERSION`` and
``name@sha256:...`` resolve from the entries themselves.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import threading
import uuid
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from executor_service.listing import RemoteFile, pieces_match
from executor_service.sources import ResolvedAdapter
from moelora.client.adapter_files import ADAPTER_FILES, files_digest
from moelora.client.errors import DataLoss
from moelora.client.logs import log_event
from moelora.client.part_digests import Pieces
from shared.refs import validate_digest

log = logging.getLogger(__name__)

_PARTIAL_PREFIX = ".partial-"
_VERSION_FILE = "version.json"
_LISTING_FILE = "files.json"
_REFERENCES_FILE = "references.json"


@dataclass(frozen=True)
class DiskEntry:
    """One cached version."""

    adapter: ResolvedAdapter
    nbytes: int


class DiskCache:
    """Adapter files on disk by digest, LRU within ``budget_bytes``; thread-safe."""

    def __init__(self, root: Path, budget_bytes: int, check_threads: int = 1) -> None:
        """``check_threads``: threads that check an entry's pieces after a restart."""
        self.root = root.expanduser()
        self.budget_bytes = budget_bytes
        self._check_threads = check_threads
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, DiskEntry] = OrderedDict()  # by digest, LRU first
        #: (size, mtime_ns) of each file when the entry was last checked against its digest.
        self._verified: dict[str, tuple[tuple[int, int], ...]] = {}
        self.root.mkdir(parents=True, exist_ok=True)
        self._scan()
        # References to versions no longer held are dropped at the next write.
        self._references = {
            ref: digest
            for ref, digest in _read_references(self.root / _REFERENCES_FILE).items()
            if digest in self._entries
        }
        self._saved_references = dict(self._references)
        self._save_lock = threading.Lock()

    @property
    def used_bytes(self) -> int:
        with self._lock:
            return sum(e.nbytes for e in self._entries.values())

    def entries(self) -> list[DiskEntry]:
        """Cached versions, least recently used first."""
        with self._lock:
            return list(self._entries.values())

    def references(self) -> dict[str, ResolvedAdapter]:
        """What each remembered moving reference resolved to, for the entries still held."""
        with self._lock:
            return {
                ref: self._entries[digest].adapter
                for ref, digest in self._references.items()
                if digest in self._entries
            }

    def remember(self, changes: Mapping[str, str | None]) -> None:
        """Records moving references -> digest (None: forget the reference). The file keeps
        those whose version is held (a reference to a version still downloading is written when
        its entry is committed), so a cache that holds nothing has no file either."""
        with self._lock:
            for ref, digest in changes.items():
                if digest is None:
                    self._references.pop(ref, None)
                else:
                    self._references[ref] = digest
        self._save_references()

    def _save_references(self) -> None:
        """Rewrites ``references.json`` whole, renamed into place, when what it should hold
        changed. Best effort: a failed write loses only what a restart during an outage would
        serve."""
        with self._save_lock:
            with self._lock:
                held = {r: d for r, d in self._references.items() if d in self._entries}
            if held == self._saved_references:
                return
            path = self.root / _REFERENCES_FILE
            temporary = path.with_name(f"{_PARTIAL_PREFIX}{uuid.uuid4().hex}.json")
            try:
                if held:
                    temporary.write_text(json.dumps(held, sort_keys=True))
                    temporary.replace(path)
                else:
                    path.unlink(missing_ok=True)
            except OSError as exc:
                temporary.unlink(missing_ok=True)
                log_event(log, "disk_cache_references_not_kept", logging.WARNING, error=str(exc))
                return
            self._saved_references = held

    def get(self, digest: str) -> Path | None:
        """The folder holding the files of ``digest``, or None when not cached (or the entry
        fails its check)."""
        with self._lock:
            if digest not in self._entries:
                return None
            self._entries.move_to_end(digest)
            verified = self._verified.get(digest)
        folder = self._folder(digest)
        stamps = _stamps(folder)
        if stamps is not None and stamps == verified:
            return folder
        if stamps is None or not self._genuine(folder, digest):
            log_event(log, "disk_cache_entry_damaged", logging.WARNING, digest=digest)
            self.remove(digest)
            return None
        with self._lock:
            self._verified[digest] = stamps
        return folder

    def reserve(self) -> Path:
        """A new empty folder inside the cache for a download to write into; ``commit``
        it, or ``discard`` it if the download fails."""
        partial = self.root / f"{_PARTIAL_PREFIX}{uuid.uuid4().hex}"
        partial.mkdir()
        return partial

    @staticmethod
    def discard(partial: Path) -> None:
        shutil.rmtree(partial, ignore_errors=True)

    def commit(
        self, adapter: ResolvedAdapter, partial: Path, listing: Sequence[RemoteFile] = ()
    ) -> list[str]:
        """Moves a reserved folder whose files were checked against ``adapter.digest`` into
        place and evicts least recently used entries beyond the budget; returns the evicted
        digests. A version larger than the whole budget is not kept. ``listing``: what the
        registry listed of the files, kept for the check after a restart when every file has
        pieces."""
        digest = adapter.digest
        size = sum((partial / name).stat().st_size for name in ADAPTER_FILES)
        if listing and all(f.pieces is not None for f in listing):
            (partial / _LISTING_FILE).write_text(json.dumps([_listed(f) for f in listing]))
        (partial / _VERSION_FILE).write_text(json.dumps(asdict(adapter)))
        with self._lock:
            keep = size <= self.budget_bytes and digest not in self._entries
            if keep:
                partial.rename(self._folder(digest))
                self._entries[digest] = DiskEntry(adapter, size)
                stamps = _stamps(self._folder(digest))
                if stamps is not None:
                    self._verified[digest] = stamps
                evicted = self._evict_locked(keep=digest)
            else:
                evicted = []
                if digest in self._entries:
                    self._entries.move_to_end(digest)
        if not keep:
            self.discard(partial)
        for gone in evicted:
            shutil.rmtree(self._folder(gone), ignore_errors=True)
        if evicted:
            log_event(log, "disk_cache_evicted", digests=evicted)
        self._save_references()  # references that waited for this entry
        return evicted

    def remove(self, digest: str) -> bool:
        """Drops ``digest``; True if it was cached."""
        with self._lock:
            known = self._entries.pop(digest, None) is not None
            self._verified.pop(digest, None)
        shutil.rmtree(self._folder(digest), ignore_errors=True)
        return known

    def shed(self) -> list[str]:
        """The volume is full (ENOSPC) below the byte budget: evicts the least recently used
        half of the entries (at least one); returns their digests, [] when empty."""
        with self._lock:
            count = (len(self._entries) + 1) // 2
            evicted = list(self._entries)[:count]
            for digest in evicted:
                del self._entries[digest]
                self._verified.pop(digest, None)
        for gone in evicted:
            shutil.rmtree(self._folder(gone), ignore_errors=True)
        if evicted:
            log_event(log, "disk_cache_shed", logging.WARNING, digests=evicted)
        return evicted

    def _evict_locked(self, keep: str) -> list[str]:
        evicted = []
        total = sum(e.nbytes for e in self._entries.values())
        for digest in list(self._entries):
            if total <= self.budget_bytes:
                break
            if digest == keep:
                continue
            total -= self._entries.pop(digest).nbytes
            self._verified.pop(digest, None)
            evicted.append(digest)
        return evicted

    def _genuine(self, folder: Path, digest: str) -> bool:
        """Whether the entry's files are those of ``digest``: by their pieces when the entry
        keeps a listing bound to the digest, else by hashing each file whole."""
        listing = _read_listing(folder)
        if listing is None or files_digest({f.path: f.sha256 for f in listing}) != digest:
            return _digest_of_folder(folder) == digest
        return all(
            f.pieces is not None and pieces_match(folder / f.path, f.pieces, self._check_threads)
            for f in listing
        )

    def _folder(self, digest: str) -> Path:
        return self.root / validate_digest(digest).removeprefix("sha256:")

    def _scan(self) -> None:
        """Adopts entries left by an earlier run (oldest access first) and removes the
        leftovers of interrupted writes and entries it cannot read."""
        found: list[tuple[float, DiskEntry]] = []
        for child in self.root.iterdir():
            if child.name == _REFERENCES_FILE:
                continue
            entry = None if child.name.startswith(_PARTIAL_PREFIX) else _read_entry(child)
            if entry is None:
                if child.is_dir():
                    shutil.rmtree(child, ignore_errors=True)
                else:
                    child.unlink(missing_ok=True)
                continue
            accessed = max((child / name).stat().st_atime for name in ADAPTER_FILES)
            found.append((accessed, entry))
        with self._lock:
            for _, entry in sorted(found, key=lambda item: item[0]):
                self._entries[entry.adapter.digest] = entry
            evicted = self._evict_locked(keep="")
        for gone in evicted:
            shutil.rmtree(self._folder(gone), ignore_errors=True)
        if found:
            log_event(
                log,
                "disk_cache_adopted",
                entries=len(found) - len(evicted),
                bytes=self.used_bytes,
            )


def _read_entry(folder: Path) -> DiskEntry | None:
    """The entry a folder holds, or None when it is not a complete, readable one."""
    try:
        adapter = ResolvedAdapter(**json.loads((folder / _VERSION_FILE).read_text()))
        nbytes = sum((folder / name).stat().st_size for name in ADAPTER_FILES)
    except (OSError, ValueError, TypeError):
        return None
    if folder.name != adapter.digest.removeprefix("sha256:"):
        return None
    return DiskEntry(adapter, nbytes)


def _read_references(path: Path) -> dict[str, str]:
    """The kept reference -> digest map; empty when there is none or it does not parse."""
    try:
        loaded = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(loaded, dict):
        return {}
    return {str(ref): str(digest) for ref, digest in loaded.items()}


def _listed(f: RemoteFile) -> dict[str, object]:
    assert f.pieces is not None
    return {
        "path": f.path,
        "size": f.size,
        "sha256": f.sha256,
        "part_size": f.pieces.size,
        "part_sha256": list(f.pieces.sha256),
    }


def _read_listing(folder: Path) -> list[RemoteFile] | None:
    """The entry's kept listing, or None when it has none (or one that does not parse, or
    that does not name exactly the adapter files: the whole-file check decides then)."""
    try:
        rows = json.loads((folder / _LISTING_FILE).read_text())
        listing = [_listed_file(row, folder.name) for row in rows]
    except (OSError, ValueError, TypeError, KeyError, DataLoss):
        return None
    if sorted(f.path for f in listing) != sorted(ADAPTER_FILES):
        return None
    return listing


def _listed_file(row: Mapping[str, Any], entry: str) -> RemoteFile:
    """One file of a kept listing; DataLoss when its pieces cannot describe it."""
    pieces = Pieces(int(row["part_size"]), tuple(str(h) for h in row["part_sha256"]))
    pieces.check(int(row["size"]), f"{entry}/{row['path']}")
    return RemoteFile(str(row["path"]), int(row["size"]), str(row["sha256"]), pieces)


def _stamps(folder: Path) -> tuple[tuple[int, int], ...] | None:
    """(size, mtime_ns) of each file, or None when one is missing."""
    try:
        stats = [(folder / name).stat() for name in ADAPTER_FILES]
    except OSError:
        return None
    return tuple((st.st_size, st.st_mtime_ns) for st in stats)


def _digest_of_folder(folder: Path) -> str | None:
    """The version digest of the files in ``folder``; None when one cannot be read."""
    hashes = {}
    try:
        for name in ADAPTER_FILES:
            with (folder / name).open("rb") as handle:
                hashes[name] = hashlib.file_digest(handle, "sha256").hexdigest()
    except OSError:
        return None
    return files_digest(hashes)
