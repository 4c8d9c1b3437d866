"""Parallel ranged downloads into arriving files: parts written out of order reassemble the
file, whether they come as objects (the gRPC stream) or are received straight into the file's
memory (HTTP); a reader sees a range as soon as it arrived (before the whole file is checked),
damaged bytes fail the check (at the end when the file is hashed whole; as soon as the piece
is in when the registry listed piece digests), a failed part reaches every waiter, and a closed
download drops what still arrives. The range reader reads a real local file, as the registry
would."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import pytest

from executor_service.arriving import ArrivingFile
from executor_service.listing import RemoteFile
from executor_service.ranged_download import Part, RangedDownload, RangeReader, _parts
from moelora.client.errors import DataLoss, Unavailable
from moelora.client.part_digests import Pieces

MIB = 1 << 20


def _piece_digests(data: bytes, size: int) -> Pieces:
    """The registry's record of ``data`` by pieces, computed independently here."""
    hashes = [hashlib.sha256(data[at : at + size]).hexdigest() for at in range(0, len(data), size)]
    return Pieces(size, tuple(hashes))


def _sources(tmp_path: Path, piece_size: int | None = None) -> tuple[list[Path], list[RemoteFile]]:
    """Two files to download; with ``piece_size``, listed with piece digests of that size."""
    paths = [tmp_path / "small.json", tmp_path / "big.bin"]
    paths[0].write_bytes(b'{"r": 8}')
    paths[1].write_bytes(os.urandom(40 * MIB + 123))
    files = []
    for p in paths:
        data = p.read_bytes()
        pieces = _piece_digests(data, piece_size) if piece_size else None
        files.append(RemoteFile(p.name, len(data), hashlib.sha256(data).hexdigest(), pieces))
    return paths, files


def _reader(paths: list[Path], *, piece: int = MIB, damage_at: int | None = None) -> RangeReader:
    """Reads parts of the local files in ``piece``s, as objects (flipping the byte at
    ``damage_at`` of the last file, as a blob store with a bad disk would)."""

    def read(part: Part) -> None:
        with paths[part.index].open("rb") as handle:
            handle.seek(part.offset)
            at, end = part.offset, part.offset + part.length
            while at < end:
                data = bytearray(handle.read(min(piece, end - at)))
                last = part.index == len(paths) - 1
                if last and damage_at is not None and at <= damage_at < at + len(data):
                    data[damage_at - at] ^= 0x01
                if not part.write(at, bytes(data)):
                    return
                at += len(data)

    return read


def _receiver(paths: list[Path], *, piece: int = MIB) -> RangeReader:
    """Receives parts straight into the file's memory, ``piece`` by piece (as a socket's
    readinto does)."""

    def read(part: Part) -> None:
        with paths[part.index].open("rb", buffering=0) as handle:
            handle.seek(part.offset)
            done = 0
            while done < part.length:
                into = part.receive(min(piece, part.length - done))
                n = handle.readinto(into)
                assert n == len(into)
                if not part.received(n):
                    return
                done += n

    return read


def _download(
    tmp_path: Path, files: list[RemoteFile], read: RangeReader, streams: int = 3
) -> RangedDownload:
    folder = tmp_path / "into"
    folder.mkdir(exist_ok=True)
    return RangedDownload(folder, files, read, streams, "adapter x:1", nice=0)


#: How files are checked: hashed whole in order, or by the registry's pieces (3 MiB: parts
#: are whole pieces, not the default part size).
CHECKS = pytest.mark.parametrize("piece_size", [None, 3 * MIB], ids=["whole", "pieces"])


@CHECKS
def test_parts_from_parallel_streams_reassemble_and_verify(
    tmp_path: Path, piece_size: int | None
) -> None:
    paths, files = _sources(tmp_path, piece_size)
    download = _download(tmp_path, files, _reader(paths))
    try:
        big = download.file("big.bin")
        big.wait(0, big.size)
        download.wait_verified()
        assert (tmp_path / "into" / "big.bin").read_bytes() == paths[1].read_bytes()
        assert bytes(big.view()) == paths[1].read_bytes()
        assert bytes(download.file("small.json").view()) == b'{"r": 8}'
    finally:
        download.close()


@CHECKS
def test_parts_received_into_the_file_reassemble_and_verify(
    tmp_path: Path, piece_size: int | None
) -> None:
    paths, files = _sources(tmp_path, piece_size)
    download = _download(tmp_path, files, _receiver(paths, piece=300_001), streams=4)
    try:
        download.wait_verified()
        assert (tmp_path / "into" / "big.bin").read_bytes() == paths[1].read_bytes()
        assert bytes(download.file("small.json").view()) == b'{"r": 8}'
    finally:
        download.close()


@CHECKS
@pytest.mark.parametrize("receive", [False, True], ids=["objects", "in-place"])
def test_a_range_is_readable_before_the_whole_file_is_checked(
    tmp_path: Path, receive: bool, piece_size: int | None
) -> None:
    paths, files = _sources(tmp_path, piece_size)
    release = threading.Event()
    inner = _receiver(paths) if receive else _reader(paths)

    def held_back(part: Part) -> None:
        if part.offset > 0:  # every part but the first waits for the test
            assert release.wait(30)
        inner(part)

    download = _download(tmp_path, files, held_back)
    try:
        big = download.file("big.bin")
        big.wait(0, 1000)  # the first part is in: usable now
        assert bytes(big.view()[:1000]) == paths[1].read_bytes()[:1000]
        verified = threading.Thread(target=download.wait_verified)
        verified.start()
        verified.join(0.3)
        assert verified.is_alive()  # not before the rest arrived and was hashed
        release.set()
        verified.join(30)
        assert not verified.is_alive()
    finally:
        release.set()
        download.close()


def test_damaged_bytes_fail_the_check_after_they_were_usable(tmp_path: Path) -> None:
    paths, files = _sources(tmp_path)
    size = files[1].size
    download = _download(tmp_path, files, _reader(paths, damage_at=size - 1))
    try:
        download.file("big.bin").wait(0, size)  # every byte arrived, the last one wrong
        with pytest.raises(DataLoss, match=r"big\.bin: the downloaded bytes have sha256"):
            download.wait_verified()
    finally:
        download.close()


@pytest.mark.parametrize("receive", [False, True], ids=["objects", "in-place"])
def test_a_damaged_piece_fails_the_download_before_the_rest_arrived(
    tmp_path: Path, receive: bool
) -> None:
    paths, files = _sources(tmp_path, piece_size=MIB)
    release = threading.Event()
    bad = paths[1].read_bytes()
    bad = bad[: MIB + 5] + bytes([bad[MIB + 5] ^ 0x01]) + bad[MIB + 6 :]
    (tmp_path / "bad").mkdir()
    damaged = [paths[0], tmp_path / "bad" / "big.bin"]
    damaged[1].write_bytes(bad)
    inner = _receiver(damaged) if receive else _reader(damaged)

    def held_back(part: Part) -> None:
        if part.index == 1 and part.offset > 0:  # all but the first part wait for the test
            assert release.wait(30)
        inner(part)

    download = _download(tmp_path, files, held_back)
    try:
        # The second piece (of the first part) is named while the other parts are held back.
        with pytest.raises(
            DataLoss,
            match=rf"big\.bin: downloaded bytes {MIB}-{2 * MIB} "
            r"\(piece 2 of 41\) have sha256 [0-9a-f]{64}, expected",
        ):
            download.wait_verified()
    finally:
        release.set()
        download.close()


def test_parts_are_whole_pieces(tmp_path: Path) -> None:
    _, files = _sources(tmp_path, piece_size=3 * MIB)
    parts = list(_parts(files, streams=3))
    big = [p for p in parts if p[0] == 1]
    assert all(offset % (3 * MIB) == 0 for _, offset, _ in big)
    assert all(length % (3 * MIB) == 0 for _, _, length in big[:-1])
    assert sum(length for _, _, length in big) == files[1].size
    assert [p for p in parts if p[0] == 0] == [(0, 0, files[0].size)]


@pytest.mark.parametrize(
    ("size", "digests"),
    [(MIB, 40), (MIB, 42), (0, 0), (MIB, -1)],
    ids=["too-few", "too-many", "no-size", "not-hex"],
)
def test_a_listing_whose_pieces_cannot_describe_the_file_is_refused(
    tmp_path: Path, size: int, digests: int
) -> None:
    paths, files = _sources(tmp_path, piece_size=MIB)
    good = files[1].pieces
    assert good is not None and len(good.sha256) == 41
    listed = ("X" * 64,) * 41 if digests < 0 else (good.sha256 * 2)[:digests]
    files[1] = RemoteFile(files[1].path, files[1].size, files[1].sha256, Pieces(size, listed))
    with pytest.raises(DataLoss, match=r"big\.bin: the registry lists \d+ piece digests"):
        _download(tmp_path, files, _reader(paths))


def test_a_failed_part_reaches_every_waiter(tmp_path: Path) -> None:
    paths, files = _sources(tmp_path)
    inner = _reader(paths)

    def failing(part: Part) -> None:
        if part.index == 1 and part.offset > 0:
            raise Unavailable("the registry went away")
        inner(part)

    download = _download(tmp_path, files, failing)
    try:
        with pytest.raises(Unavailable, match="went away"):
            download.file("big.bin").wait(0, files[1].size)
        with pytest.raises(Unavailable, match="went away"):
            download.wait_verified()
    finally:
        download.close()


@pytest.mark.parametrize("receive", [False, True], ids=["objects", "in-place"])
def test_closing_drops_what_still_arrives(tmp_path: Path, receive: bool) -> None:
    paths, files = _sources(tmp_path)
    inside = threading.Event()
    release = threading.Event()
    told_to_stop = threading.Event()

    def slow(part: Part) -> None:
        if part.index != 1 or part.offset == 0:
            (_receiver(paths) if receive else _reader(paths))(part)
            return
        inside.set()
        assert release.wait(30)
        if receive:
            part.receive(10)[:] = b"x" * 10  # lands in memory of a file no longer kept: harmless
            stopped = not part.received(10)
        else:
            stopped = not part.write(part.offset, b"x" * 10)
        if stopped:
            told_to_stop.set()

    download = _download(tmp_path, files, slow, streams=2)
    assert inside.wait(30)
    download.close()  # a worker is still receiving: not waited for
    release.set()
    assert told_to_stop.wait(30)
    big = download.file("big.bin")
    with pytest.raises(RuntimeError, match="abandoned"):
        big.wait(0, big.size)


def test_a_part_takes_its_bytes_in_order_from_a_piece_boundary(tmp_path: Path) -> None:
    """A worker's bytes are hashed as they pass, so they must come front to back: a gap or a
    repeat is refused (naming the offsets) rather than hashed into the wrong piece."""
    paths, files = _sources(tmp_path, piece_size=MIB)
    data = paths[1].read_bytes()

    def skipping(part: Part) -> None:
        if part.index == 1 and part.offset == 0:
            assert part.write(0, data[:1000])
            part.write(2000, data[2000:3000])  # bytes 1000-2000 never came
        else:
            _reader(paths)(part)

    download = _download(tmp_path, files, skipping)
    try:
        with pytest.raises(DataLoss, match="bytes for offset 2000 arrived, expected offset 1000"):
            download.wait_verified()
    finally:
        download.close()
    pieces = _piece_digests(data[: 3 * MIB], MIB)
    file = ArrivingFile(tmp_path / "x.bin", 3 * MIB, "0" * 64, "x.bin", 0, pieces)
    try:
        with pytest.raises(ValueError, match="starts inside a piece"):
            file.inflow(MIB + 1)
    finally:
        file.close()
