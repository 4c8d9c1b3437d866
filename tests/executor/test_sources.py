"""The local folder adapter source: layouts, resolution, digests, changed or missing files."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from executor_service.sources import LocalFolderSource
from moelora.client.adapter_files import CONFIG_FILE, WEIGHTS_FILE, files_digest
from moelora.client.errors import DataLoss, FailedPrecondition, NotFound
from shared.refs import AdapterRef


def _adapter(folder: Path, payload: bytes) -> None:
    folder.mkdir(parents=True)
    (folder / CONFIG_FILE).write_text(json.dumps({"r": 4}))
    (folder / WEIGHTS_FILE).write_bytes(payload)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    _adapter(tmp_path / "flat", b"flat")
    _adapter(tmp_path / "versioned" / "1", b"one")
    _adapter(tmp_path / "versioned" / "2", b"two")
    _adapter(tmp_path / "versioned" / "10", b"ten")
    return tmp_path


def test_digest_is_over_sorted_file_hashes(root: Path) -> None:
    source = LocalFolderSource(root)
    flat = source.resolve(AdapterRef.parse("flat"))
    hashes = {
        name: hashlib.sha256((root / "flat" / name).read_bytes()).hexdigest()
        for name in (WEIGHTS_FILE, CONFIG_FILE)
    }
    expected = hashlib.sha256(
        "".join(f"{name}\0{hashes[name]}\n" for name in sorted(hashes)).encode()
    ).hexdigest()
    assert flat.digest == files_digest(hashes) == f"sha256:{expected}"
    assert (flat.name, flat.version, flat.label) == ("flat", 1, "flat:1")
    files = source.fetch(flat)
    assert files.config == {"r": 4} and files.weights == b"flat"


def test_versions_resolve_by_number_newest_and_digest(root: Path) -> None:
    source = LocalFolderSource(root)
    assert source.resolve(AdapterRef.parse("versioned")).version == 10
    two = source.resolve(AdapterRef.parse("versioned:2"))
    assert source.fetch(two).weights == b"two"
    by_digest = source.resolve(AdapterRef.parse(f"versioned@{two.digest}"))
    assert by_digest == two
    with pytest.raises(NotFound, match="no version 3"):
        source.resolve(AdapterRef.parse("versioned:3"))
    with pytest.raises(NotFound, match="no aliases"):
        source.resolve(AdapterRef.parse("versioned@prod"))
    with pytest.raises(NotFound, match="not found"):
        source.resolve(AdapterRef.parse("missing"))


def test_changed_and_missing_files(root: Path) -> None:
    source = LocalFolderSource(root)
    flat = source.resolve(AdapterRef.parse("flat"))
    (root / "flat" / WEIGHTS_FILE).write_bytes(b"changed!")
    with pytest.raises(DataLoss, match=r"files from .*flat have digest sha256:\w+, expected"):
        source.fetch(flat)
    assert source.resolve(AdapterRef.parse("flat")).digest != flat.digest
    (root / "flat" / WEIGHTS_FILE).unlink()
    with pytest.raises(FailedPrecondition, match=WEIGHTS_FILE):
        source.resolve(AdapterRef.parse("flat"))
    (root / "bad").mkdir()
    (root / "bad" / CONFIG_FILE).write_text("{not json")
    (root / "bad" / WEIGHTS_FILE).write_bytes(b"x")
    bad = source.resolve(AdapterRef.parse("bad"))
    with pytest.raises(FailedPrecondition, match="not valid JSON"):
        source.fetch(bad)


def test_resolve_at_once_answers_only_from_remembered_hashes(root: Path) -> None:
    source = LocalFolderSource(root, recheck_seconds=0)
    flat = AdapterRef.parse("flat", "adapter")
    assert source.resolve_at_once(flat) is None  # its files were never read
    resolved = source.resolve(flat)
    assert source.resolve_at_once(flat) == resolved
    (root / "flat" / WEIGHTS_FILE).write_bytes(b"changed!")
    assert source.resolve_at_once(flat) is None  # a changed file is read again first
    assert source.resolve(flat).digest != resolved.digest
    with pytest.raises(NotFound):
        source.resolve_at_once(AdapterRef.parse("missing", "adapter"))


def test_resolve_at_once_trusts_its_last_answer_for_recheck_seconds(root: Path) -> None:
    source = LocalFolderSource(root, recheck_seconds=3600)
    flat = AdapterRef.parse("flat", "adapter")
    first = source.resolve(flat)
    (root / "flat" / WEIGHTS_FILE).write_bytes(b"changed!")
    assert source.resolve_at_once(flat) == first  # not looked at again within the hour
    second = source.resolve(flat)  # resolve always looks, and is remembered
    assert second.digest != first.digest
    assert source.resolve_at_once(flat) == second
