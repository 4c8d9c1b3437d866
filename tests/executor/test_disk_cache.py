"""The disk cache of downloaded adapters: budget and LRU, damaged entries, restarts (checked
whole, or by the pieces the registry listed)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from executor_service.disk_cache import DiskCache
from executor_service.listing import RemoteFile
from executor_service.sources import ResolvedAdapter
from moelora.client.adapter_files import CONFIG_FILE, WEIGHTS_FILE, digest_of_files
from moelora.client.part_digests import Pieces


def _files(seed: int, size: int = 100) -> dict[str, bytes]:
    return {CONFIG_FILE: b'{"r": %d}' % seed, WEIGHTS_FILE: bytes([seed % 256]) * size}


def _store(cache: DiskCache, files: dict[str, bytes]) -> tuple[str, list[str]]:
    digest = digest_of_files(files)
    partial = cache.reserve()
    for name, data in files.items():
        (partial / name).write_bytes(data)
    return digest, cache.commit(ResolvedAdapter("a", len(files[WEIGHTS_FILE]), digest), partial)


def _read(cache: DiskCache, digest: str) -> dict[str, bytes] | None:
    folder = cache.get(digest)
    return None if folder is None else {name: (folder / name).read_bytes() for name in _files(0)}


def _digests(cache: DiskCache) -> list[str]:
    return [entry.adapter.digest for entry in cache.entries()]


def test_round_trip_and_lru_eviction_within_budget(tmp_path: Path) -> None:
    cache = DiskCache(tmp_path / "cache", budget_bytes=250)
    a, _ = _store(cache, _files(1))
    b, _ = _store(cache, _files(2))
    assert _read(cache, a) == _files(1)  # a is now the most recently used
    c, evicted = _store(cache, _files(3))
    assert evicted == [b]
    assert cache.get(b) is None and _read(cache, a) == _files(1) and _read(cache, c) == _files(3)
    assert cache.used_bytes <= 250
    assert [p.name for p in (tmp_path / "cache").iterdir() if p.name.startswith(".")] == []


def test_a_version_larger_than_the_budget_is_not_kept(tmp_path: Path) -> None:
    cache = DiskCache(tmp_path, budget_bytes=50)
    digest, evicted = _store(cache, _files(1))
    assert evicted == [] and cache.get(digest) is None and _digests(cache) == []


def test_damaged_entries_are_dropped_not_served(tmp_path: Path) -> None:
    cache = DiskCache(tmp_path, budget_bytes=10_000)
    digest, _ = _store(cache, _files(1))
    (tmp_path / digest.removeprefix("sha256:") / WEIGHTS_FILE).write_bytes(b"tampered")
    assert cache.get(digest) is None
    assert digest not in _digests(cache)


def test_a_restart_adopts_entries_and_removes_interrupted_writes(tmp_path: Path) -> None:
    first = DiskCache(tmp_path, budget_bytes=10_000)
    digest, _ = _store(first, _files(7))
    leftover = first.reserve()
    (leftover / CONFIG_FILE).write_bytes(b"half")
    (tmp_path / "not-an-entry").mkdir()
    second = DiskCache(tmp_path, budget_bytes=10_000)
    assert [entry.adapter for entry in second.entries()] == [ResolvedAdapter("a", 100, digest)]
    assert not (tmp_path / "not-an-entry").exists()
    assert _read(second, digest) == _files(7)
    assert not leftover.exists()
    assert second.remove(digest) and second.get(digest) is None


def test_a_restart_checks_each_entry_once_before_serving_it(tmp_path: Path) -> None:
    first = DiskCache(tmp_path, budget_bytes=10_000)
    digest, _ = _store(first, _files(5))
    weights = tmp_path / digest.removeprefix("sha256:") / WEIGHTS_FILE
    weights.write_bytes(b"\x00" * 100)  # same size: only the hash tells
    second = DiskCache(tmp_path, budget_bytes=10_000)
    assert second.get(digest) is None and not weights.exists()


def _listing(files: dict[str, bytes], piece: int) -> list[RemoteFile]:
    """What the registry lists of ``files`` with pieces of ``piece`` bytes, hashed here."""
    return [
        RemoteFile(
            name,
            len(data),
            hashlib.sha256(data).hexdigest(),
            Pieces(
                piece,
                tuple(
                    hashlib.sha256(data[at : at + piece]).hexdigest()
                    for at in range(0, len(data), piece)
                ),
            ),
        )
        for name, data in files.items()
    ]


def _store_listed(cache: DiskCache, files: dict[str, bytes], piece: int = 16) -> str:
    digest = digest_of_files(files)
    partial = cache.reserve()
    for name, data in files.items():
        (partial / name).write_bytes(data)
    adapter = ResolvedAdapter("a", len(files[WEIGHTS_FILE]), digest)
    cache.commit(adapter, partial, _listing(files, piece))
    return digest


def _varied(seed: int) -> dict[str, bytes]:
    return {CONFIG_FILE: b'{"r": %d}' % seed, WEIGHTS_FILE: bytes(range(seed, seed + 100))}


def test_after_a_restart_an_entry_with_pieces_is_checked_by_them(tmp_path: Path) -> None:
    digest = _store_listed(DiskCache(tmp_path, 10_000), _varied(3))
    assert (tmp_path / digest.removeprefix("sha256:") / "files.json").is_file()
    restarted = DiskCache(tmp_path, 10_000, check_threads=3)
    assert _read(restarted, digest) == _varied(3)


def test_after_a_restart_a_damaged_piece_drops_the_entry(tmp_path: Path) -> None:
    digest = _store_listed(DiskCache(tmp_path, 10_000), _varied(4))
    weights = tmp_path / digest.removeprefix("sha256:") / WEIGHTS_FILE
    data = bytearray(weights.read_bytes())
    data[57] ^= 0x01  # same size: only a hash tells
    weights.write_bytes(bytes(data))
    assert DiskCache(tmp_path, 10_000, check_threads=3).get(digest) is None
    assert not weights.exists()


def test_the_pieces_kept_are_what_the_check_goes_by(tmp_path: Path) -> None:
    """A kept piece digest that no longer matches drops the entry though the files are whole:
    the restart's check reads the listing (it cannot tell which of the two was damaged)."""
    digest = _store_listed(DiskCache(tmp_path, 10_000), _varied(5))
    kept = tmp_path / digest.removeprefix("sha256:") / "files.json"
    rows = json.loads(kept.read_text())
    weights = next(row for row in rows if row["path"] == WEIGHTS_FILE)
    weights["part_sha256"][2] = "0" * 64
    kept.write_text(json.dumps(rows))
    assert DiskCache(tmp_path, 10_000).get(digest) is None


@pytest.mark.parametrize("damage", ["other-sha256", "unreadable", "missing"])
def test_a_listing_not_bound_to_the_digest_falls_back_to_whole_files(
    tmp_path: Path, damage: str
) -> None:
    digest = _store_listed(DiskCache(tmp_path, 10_000), _varied(6))
    kept = tmp_path / digest.removeprefix("sha256:") / "files.json"
    if damage == "other-sha256":
        rows = json.loads(kept.read_text())
        rows[0]["sha256"] = "0" * 64
        kept.write_text(json.dumps(rows))
    elif damage == "unreadable":
        kept.write_text("{not json")
    else:
        kept.unlink()
    assert _read(DiskCache(tmp_path, 10_000), digest) == _varied(6)
