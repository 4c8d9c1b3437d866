"""The disk cache of downloaded adapters: budget and LRU, damaged entries, restarts."""

from __future__ import annotations

from pathlib import Path

from executor_service.disk_cache import DiskCache
from executor_service.sources import ResolvedAdapter
from shared.adapter_files import CONFIG_FILE, WEIGHTS_FILE, digest_of_files


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
