"""The blob HTTP server: GetDownloadUrls answers signed URLs for the local store; they read
whole files and byte ranges (kept-alive connections), refuse what they do not grant (tampered,
expired, another blob's, unsigned: 403, before anything is said of the blob), bad ranges (416)
and missing blobs (404), never pass a short body off as complete, and stop with the registry.
The shared ``UrlRangeReader`` (what executors receive ranges with) is checked against it."""

from __future__ import annotations

import http.client
import itertools
import socket
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import parse_qs, urlencode, urlsplit

import grpc
import pytest

from moelora.client.errors import MoeLoraError
from registry_service import blob_reads
from registry_service.byte_ranges import RangeNotSatisfiable, parse_range
from registry_service.url_signing import SignatureRejected, UrlSigner
from shared.url_ranges import STEP_BYTES, HttpStatusError, UrlRangeReader
from tests.conftest import wait_for
from tests.registry.conftest import BASE, Served, register_base
from tests.registry.fixtures import Collect, write_adapter

WEIGHTS = "adapter_model.safetensors"
RANK = 256  # 448 KiB of weights


@pytest.fixture
def served(serve: Callable[..., Served], tmp_path: Path, base_model_dir: Path) -> Served:
    registry = serve(blob_url=f"file://{tmp_path / 'blobs'}", http_listen="127.0.0.1:0")
    with registry.client() as client:
        register_base(client, base_model_dir)
        client.upload(write_adapter(tmp_path / "a", rank=RANK), "a", BASE)
        client.upload(write_adapter(tmp_path / "b", rank=8, seed=5), "b", BASE)
    return registry


def _urls(served: Served, ref: str = "a:1", seconds: int = 0) -> dict[str, str]:
    with served.client() as client:
        return {f.file.path: f.url for f in client.download_urls(ref, seconds).files}


def _get(
    url: str, headers: dict[str, str] | None = None, method: str = "GET"
) -> tuple[int, dict[str, str], bytes]:
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.netloc, timeout=10)
    try:
        connection.request(method, f"{parts.path}?{parts.query}", headers=headers or {})
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


def _with_query(url: str, **changes: str) -> str:
    parts = urlsplit(url)
    query = {k: v[0] for k, v in parse_qs(parts.query).items()} | changes
    return parts._replace(query=urlencode(query)).geturl()


def test_signed_urls_read_files_and_ranges(served: Served, tmp_path: Path) -> None:
    urls = _urls(served)
    weights = (tmp_path / "a" / WEIGHTS).read_bytes()
    size = len(weights)
    assert served.app.blob_http is not None
    assert urls[WEIGHTS].startswith(f"http://127.0.0.1:{served.app.blob_http.port}/v1/blobs/")
    status, headers, body = _get(urls[WEIGHTS])
    assert (status, body, headers["Content-Length"]) == (200, weights, str(size))
    assert headers["Accept-Ranges"] == "bytes"
    for asked, begin, end in [
        ("bytes=0-0", 0, 1),
        (f"bytes={size - 1}-{size - 1}", size - 1, size),
        ("bytes=100-", 100, size),
        (f"bytes=10-{size + 500}", 10, size),  # the last byte is clipped to the blob
        ("bytes=-7", size - 7, size),
        (f"bytes=-{size + 9}", 0, size),
    ]:
        status, headers, body = _get(urls[WEIGHTS], {"Range": asked})
        assert status == 206, asked
        assert body == weights[begin:end], asked
        assert headers["Content-Range"] == f"bytes {begin}-{end - 1}/{size}", asked
        assert headers["Content-Length"] == str(end - begin), asked
    status, headers, body = _get(urls[WEIGHTS], {"Range": "items=0-3"})  # another unit: ignored
    assert (status, body) == (200, weights)
    status, headers, body = _get(urls[WEIGHTS], method="HEAD")
    assert (status, headers["Content-Length"], body) == (200, str(size), b"")
    # The client that adapterctl download --presigned uses checks every file's sha256.
    with served.client() as client:
        client.download_presigned("a:1", tmp_path / "direct")
    assert (tmp_path / "direct" / WEIGHTS).read_bytes() == weights


def test_bad_ranges_are_416_with_the_blob_size(served: Served, tmp_path: Path) -> None:
    url = _urls(served)[WEIGHTS]
    size = (tmp_path / "a" / WEIGHTS).stat().st_size
    for asked in [
        f"bytes={size}-",
        f"bytes={size}-{size + 10}",
        "bytes=9-3",
        "bytes=-0",
        "bytes=-",
        "bytes=0-1,5-9",
        "bytes=abc",
        "bytes=1-2-3",
    ]:
        status, headers, body = _get(url, {"Range": asked})
        assert status == 416, asked
        assert headers["Content-Range"] == f"bytes */{size}", asked
        assert headers["Content-Length"] == str(len(body)) and body.strip(), asked


def test_urls_that_grant_nothing_are_refused_before_the_blob_is_named(
    served: Served, tmp_path: Path
) -> None:
    a, b = _urls(served), _urls(served, "b:1")
    url = a[WEIGHTS]
    signature = parse_qs(urlsplit(url).query)["signature"][0]
    expires = int(parse_qs(urlsplit(url).query)["expires"][0])
    flipped = ("0" if signature[0] != "0" else "1") + signature[1:]
    other_blob = urlsplit(b[WEIGHTS])
    key = "sha256/" + urlsplit(url).path.rsplit("/", 1)[1]
    refused = {
        "tampered signature": _with_query(url, signature=flipped),
        "expiry moved": _with_query(url, expires=str(expires + 3600)),
        "another blob's grant": urlsplit(url)._replace(query=other_blob.query).geturl(),
        "no grant": urlsplit(url)._replace(query="").geturl(),
        "two grants": url + "&signature=" + signature,
        "expires not a number": _with_query(url, expires="soon"),
        "another registry's key": UrlSigner.random().url(
            f"http://{urlsplit(url).netloc}", key, expires
        ),
    }
    for why, bad in refused.items():
        status, headers, body = _get(bad, {"Range": "bytes=0-99"})
        assert status == 403, why
        assert headers["Content-Length"] == str(len(body)) and b"GetDownloadUrls" in body, why
    # Expired: signed correctly, in the past.
    blob_http = served.app.blob_http
    assert blob_http is not None
    past = blob_http.urls.signer.url(blob_http.urls.base_url, key, int(time.time()) - 1)
    status, _, body = _get(past)
    assert status == 403 and b"expired" in body
    # A valid grant for a blob that is gone: 404 (only a holder of a grant learns that).
    (served.settings.data_path.parent / "blobs" / key).unlink()
    assert _get(url)[0] == 404
    unsigned_missing = urlsplit(url)._replace(query="").geturl()
    assert _get(unsigned_missing)[0] == 403
    assert _get(f"http://{urlsplit(url).netloc}/v1/blobs/nothing")[0] == 404


def test_a_body_cut_short_is_never_complete(
    served: Served, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """If the file is shorter than the Content-Length already sent (damaged while it was
    sent), the server ends the connection short: clients see an incomplete body."""
    import os

    def fstat(fd: int) -> SimpleNamespace:
        return SimpleNamespace(st_size=os.fstat(fd).st_size + 1000)

    monkeypatch.setattr(blob_reads, "os", SimpleNamespace(fstat=fstat))
    url = _urls(served)[WEIGHTS]
    with pytest.raises(http.client.IncompleteRead):
        _get(url)
    reader = UrlRangeReader(timeout=10)
    size = (tmp_path / "a" / WEIGHTS).stat().st_size
    with pytest.raises(ConnectionError, match=f"ended at byte {size}, expected {size + 1000}"):
        reader.read(url, 0, size + 1000, Collect(size + 1000))
    reader.close()


def _read(reader: UrlRangeReader, url: str, begin: int, end: int, step: int) -> bytes:
    """Bytes ``begin`` to ``end`` of ``url``, received ``step`` bytes at most at a time."""
    sink = Collect(end - begin, step)
    reader.read(url, begin, end - begin, sink)
    assert sum(sink.steps) == end - begin and max(sink.steps) <= step
    return bytes(sink.data)


def test_the_range_reader_keeps_connections_and_receives_in_place(
    served: Served, tmp_path: Path
) -> None:
    url = _urls(served)[WEIGHTS]
    weights = (tmp_path / "a" / WEIGHTS).read_bytes()
    blob_http = served.app.blob_http
    assert blob_http is not None
    reader = UrlRangeReader(timeout=10)
    try:
        cuts = [0, 1, 65_536, len(weights) // 2, len(weights)]
        pieces = [_read(reader, url, b, e, step=100_003) for b, e in itertools.pairwise(cuts)]
        assert b"".join(pieces) == weights
        assert blob_http.open_connections == 1  # one kept-alive connection
        # The server drops idle connections (its timeout, a restart): the reader reconnects.
        blob_http.drop_connections()
        wait_for(lambda: not blob_http.open_connections)
        assert _read(reader, url, 0, len(weights), step=STEP_BYTES) == weights
        # A receiver that stops early: the connection is not reused (its body is unread).
        stopping = Collect(len(weights), step=4096, stop_after=1)
        reader.read(url, 0, len(weights), stopping)
        assert stopping.steps == [4096]
        assert _read(reader, url, 10, 20, step=4096) == weights[10:20]
        with pytest.raises(HttpStatusError) as info:
            _read(reader, _with_query(url, signature="0" * 64), 0, 10, step=4096)
        assert info.value.status == 403 and "signature" in info.value.message
    finally:
        reader.close()


def test_the_server_lives_and_stops_with_the_registry(
    serve: Callable[..., Served], tmp_path: Path, base_model_dir: Path
) -> None:
    off = serve(blob_url=f"file://{tmp_path / 'blobs'}", http_listen="")
    assert off.app.blob_http is None
    with off.client() as client:
        register_base(client, base_model_dir)
        client.upload(write_adapter(tmp_path / "a"), "a", BASE)
        with pytest.raises(MoeLoraError) as info:
            client.download_urls("a:1")
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "--http-listen" in info.value.message
    on = serve(data_dir=tmp_path / "on", http_listen="127.0.0.1:0")
    assert on.app.blob_http is not None
    port = on.app.blob_http.port
    idle = socket.create_connection(("127.0.0.1", port))  # a kept-alive client, idle
    idle.sendall(b"HEAD /v1/blobs/x HTTP/1.1\r\nHost: registry\r\n\r\n")
    assert idle.recv(4096).startswith(b"HTTP/1.1 404")
    on.server.drain()
    started = time.monotonic()
    on.app.close()
    assert time.monotonic() - started < 2  # idle connections do not hold the close up
    assert idle.recv(1) == b""
    idle.close()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2)


def test_ranges_and_signatures_as_plain_functions() -> None:
    assert parse_range(None, 10) is None
    assert parse_range("bytes=2-4", 10) == (2, 5)
    assert parse_range(" bytes = 2- ", 10) == (2, 10)
    assert parse_range("BYTES=-3", 10) == (7, 10)
    for bad in ("bytes=10-", "bytes=-0", "bytes=3-2", "bytes=0-1,2-3"):
        with pytest.raises(RangeNotSatisfiable):
            parse_range(bad, 10)
    with pytest.raises(RangeNotSatisfiable):
        parse_range("bytes=0-", 0)  # an empty blob has no byte to give
    signer = UrlSigner(b"k" * 32)
    key = "sha256/" + "ab" * 32
    url = signer.url("http://registry:50053/", key, 2000)
    assert url.startswith(f"http://registry:50053/v1/blobs/{key}?expires=2000&signature=")
    signature = parse_qs(urlsplit(url).query)["signature"][0]
    signer.check(key, "2000", signature, now=1999)
    for args, now in [
        ((key, "2000", signature), 2000.0),  # expired: valid until, not at, the time
        ((key, "2001", signature), 1000.0),
        (("sha256/" + "cd" * 32, "2000", signature), 1000.0),
        ((key, "2000", signature.upper()), 1000.0),
        ((key, "-1", signature), 1000.0),
    ]:
        with pytest.raises(SignatureRejected):
            signer.check(*args, now=now)
    with pytest.raises(ValueError):
        UrlSigner(b"short")
