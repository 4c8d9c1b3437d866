"""Signed, expiring blob URLs: what S3's presigned URLs are, for the registry's own HTTP server.

A URL names one blob and an expiry time; its signature is an HMAC-SHA256, under a key only the
registry holds, of both. Holding the URL is the grant to read that blob until it expires: the
registry hands URLs out only through GetDownloadUrls, which needs the same role as
DownloadAdapter, so the HTTP path grants no more than the gRPC one. Nothing else is signed: the
method (GET and HEAD read the same bytes) and the byte range are the reader's choice, as with S3.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from pathlib import Path
from urllib.parse import urlencode

from registry_service.blobs.base import is_blob_key

#: The path under which blobs are served: ``/v1/blobs/sha256/<hex>``.
PATH_PREFIX = "/v1/blobs/"
#: Bumped if what is signed ever changes, so old URLs fail cleanly instead of verifying wrongly.
_SCHEME = b"moelora-blob-url-v1"
_KEY_BYTES = 32


class SignatureRejected(Exception):
    """A URL that grants nothing; the message says why (for the 403 body and the log)."""


class UrlSigner:
    """Signs and checks blob URLs with one secret key."""

    def __init__(self, key: bytes) -> None:
        if len(key) < 16:
            raise ValueError("a URL signing key needs at least 16 bytes")
        self._key = key

    @classmethod
    def random(cls) -> UrlSigner:
        """A key of this process only: URLs it signs are valid nowhere else (one replica)."""
        return cls(secrets.token_bytes(_KEY_BYTES))

    @classmethod
    def from_file(cls, path: Path) -> UrlSigner:
        """The key shared by replicas: the file's bytes, surrounding white space removed."""
        return cls(path.expanduser().read_bytes().strip())

    def _signature(self, key: str, expires: int) -> str:
        message = b"\n".join((_SCHEME, key.encode(), str(expires).encode()))
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()

    def url(self, base_url: str, key: str, expires: int) -> str:
        """``base_url`` + the blob's path + the query that grants it until ``expires`` (Unix
        seconds)."""
        if not is_blob_key(key):
            raise ValueError(f"not a blob key: {key!r}")
        query = urlencode({"expires": expires, "signature": self._signature(key, expires)})
        return f"{base_url.rstrip('/')}{PATH_PREFIX}{key}?{query}"

    def check(self, key: str, expires: str, signature: str, now: float | None = None) -> None:
        """Raises SignatureRejected unless ``signature`` grants ``key`` until ``expires`` and
        that time has not passed."""
        if not (expires.isascii() and expires.isdigit()) or len(expires) > 12:
            raise SignatureRejected("the URL has no valid 'expires' (Unix seconds)")
        expected = self._signature(key, int(expires))
        # Constant time: the comparison must not tell how much of a forged signature is right.
        if not hmac.compare_digest(expected.encode(), signature.encode()):
            raise SignatureRejected(
                "the URL's signature does not match (tampered, or signed "
                "for another blob or by another registry)"
            )
        if int(expires) <= (time.time() if now is None else now):
            raise SignatureRejected(f"the URL expired at {expires} (Unix seconds)")
