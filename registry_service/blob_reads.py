"""What the blob HTTP server answers, as plain classes: signed URLs made, checked and turned
into an open blob and a byte range (registry_service/blob_http.py only moves the bytes).

The order of the checks is the order of what a caller may learn: a URL that grants nothing is
refused (403) before anything is said about the blob, so a missing blob (404) or a bad range
(416) is only ever told to a holder of a valid URL.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import BinaryIO
from urllib.parse import parse_qs, urlsplit

from registry_service.blobs.base import is_blob_key
from registry_service.blobs.local import LocalBlobStore
from registry_service.byte_ranges import RangeNotSatisfiable, parse_range
from registry_service.url_signing import PATH_PREFIX, SignatureRejected, UrlSigner


class HttpRefusal(Exception):
    """A request answered with an error status; ``message`` is the body a person reads."""

    def __init__(self, status: HTTPStatus, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}


@dataclass
class BlobRead:
    """An open blob and the bytes ``[begin, end)`` of it to send; the caller closes ``file``."""

    key: str
    file: BinaryIO
    size: int
    begin: int
    end: int
    partial: bool
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def length(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class UrlMaker:
    """Signs URLs of blobs under ``base_url`` (what GetDownloadUrls hands out)."""

    signer: UrlSigner
    base_url: str
    clock: Callable[[], float] = time.time

    def url(self, key: str, expires_in_seconds: int) -> str:
        return self.signer.url(self.base_url, key, int(self.clock()) + expires_in_seconds)


class BlobReads:
    """Turns a request (target and Range header) into a ``BlobRead`` of ``blobs``, or raises
    HttpRefusal."""

    def __init__(
        self, blobs: LocalBlobStore, signer: UrlSigner, clock: Callable[[], float] = time.time
    ) -> None:
        self._blobs = blobs
        self._signer = signer
        self._clock = clock

    def open(self, target: str, range_header: str | None) -> BlobRead:
        parts = urlsplit(target)
        key = parts.path.removeprefix(PATH_PREFIX)
        if not parts.path.startswith(PATH_PREFIX) or not is_blob_key(key):
            raise HttpRefusal(HTTPStatus.NOT_FOUND, f"no blob at {parts.path}")
        query = parse_qs(parts.query)
        expires, signature = query.get("expires", []), query.get("signature", [])
        if len(expires) != 1 or len(signature) != 1:
            raise HttpRefusal(
                HTTPStatus.FORBIDDEN,
                "the URL carries no grant: take it from GetDownloadUrls unchanged",
            )
        try:
            self._signer.check(key, expires[0], signature[0], self._clock())
        except SignatureRejected as exc:
            raise HttpRefusal(HTTPStatus.FORBIDDEN, f"{exc}; ask GetDownloadUrls again") from None
        try:
            blob = self._blobs.open_file(key)
        except FileNotFoundError:
            raise HttpRefusal(HTTPStatus.NOT_FOUND, f"blob {key} is missing") from None
        try:
            size = os.fstat(blob.fileno()).st_size
            span = parse_range(range_header, size)
        except RangeNotSatisfiable as exc:
            blob.close()
            raise HttpRefusal(
                HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE,
                str(exc),
                {"Content-Range": f"bytes */{size}"},
            ) from None
        except BaseException:
            blob.close()
            raise
        begin, end = span if span is not None else (0, size)
        headers = {"ETag": f'"{key.removeprefix("sha256/")}"'}  # content-addressed
        if span is not None:
            headers["Content-Range"] = f"bytes {begin}-{end - 1}/{size}"
        return BlobRead(key, blob, size, begin, end, span is not None, headers)
