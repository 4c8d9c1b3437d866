"""BackgroundWriter's pieces: one sha256 per piece of the bytes written, whatever the chunk
sizes (chunks straddle piece boundaries, are smaller or larger than a piece), the short last
piece included, checked against hashlib over each slice."""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import pytest

from moelora.client.background_writer import BackgroundWriter
from moelora.client.part_digests import PartHasher


def _slices(data: bytes, part_size: int) -> tuple[str, ...]:
    return tuple(
        hashlib.sha256(data[at : at + part_size]).hexdigest()
        for at in range(0, len(data), part_size)
    )


@pytest.mark.parametrize(
    ("size", "part_size", "chunk"),
    [
        (4096, 1024, 1024),  # chunks on the boundaries
        (4097, 1024, 333),  # one byte over, chunks straddling
        (1000, 1024, 100),  # under one piece
        (10_000, 1024, 3000),  # chunks spanning several pieces
        (0, 1024, 1),  # nothing: no pieces
    ],
)
def test_writer_hashes_every_piece(tmp_path: Path, size: int, part_size: int, chunk: int) -> None:
    data = random.Random(size).randbytes(size)
    writer = BackgroundWriter(tmp_path / "f", sync_every=2048, part_size=part_size)
    for at in range(0, size, chunk):
        writer.write(data[at : at + chunk])
    digests = writer.close(sync=True)
    assert (tmp_path / "f").read_bytes() == data
    assert digests.sha256 == hashlib.sha256(data).hexdigest()
    assert digests.part_size_bytes == part_size
    assert digests.part_sha256 == _slices(data, part_size)
    assert len(digests.part_sha256) == -(-size // part_size)


def test_writer_without_pieces(tmp_path: Path) -> None:
    writer = BackgroundWriter(tmp_path / "f")
    writer.write(b"abc")
    digests = writer.close()
    assert (digests.sha256, digests.part_size_bytes, digests.part_sha256) == (
        hashlib.sha256(b"abc").hexdigest(),
        0,
        (),
    )


def test_hasher_takes_memoryviews_and_refuses_a_zero_size() -> None:
    hasher = PartHasher(4)
    hasher.update(memoryview(b"0123456789")[1:])
    assert hasher.finish() == _slices(b"123456789", 4)
    with pytest.raises(ValueError, match="part_size"):
        PartHasher(0)
