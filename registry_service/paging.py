"""Where page tokens are made and read. A token is opaque to clients: URL-safe base64 of JSON
holding the last key of the page and a hash of the filters, signed with a key every replica
shares (the database's ``page_tokens`` server key), so that a token sent with other filters,
edited or made up is refused instead of resuming anywhere; what a valid token says is checked
again against the key's shape before it reaches a query."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from collections.abc import Sequence
from typing import Any

from moelora.client.errors import InvalidArgument

DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000
#: Longer tokens are refused unread (a real one holds a name of 128 characters at most).
MAX_TOKEN_CHARS = 2048
_SIGNATURE_BYTES = 16
_INT64 = 2**63

_MALFORMED = "page_token: malformed; pass next_page_token unchanged"


def page_size(requested: int) -> int:
    if requested == 0:
        return DEFAULT_PAGE_SIZE
    if not 1 <= requested <= MAX_PAGE_SIZE:
        raise InvalidArgument(
            f"page_size: {requested} is outside 1-{MAX_PAGE_SIZE} (0 means {DEFAULT_PAGE_SIZE})",
            "page_size",
        )
    return requested


def _filter_hash(filters: Any) -> str:
    text = json.dumps(filters, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class PageTokens:
    """Makes and reads the page tokens of one registry (``key``: its shared secret)."""

    def __init__(self, key: bytes) -> None:
        self._key = key

    def _sign(self, payload: bytes) -> bytes:
        return hmac.new(self._key, payload, hashlib.sha256).digest()[:_SIGNATURE_BYTES]

    def encode(self, last_key: list[Any], filters: Any) -> str:
        payload = json.dumps({"k": last_key, "f": _filter_hash(filters)}, separators=(",", ":"))
        raw = self._sign(payload.encode()) + payload.encode()
        return base64.urlsafe_b64encode(raw).decode().rstrip("=")

    def decode(self, token: str, filters: Any, shape: Sequence[type]) -> list[Any] | None:
        """The last key of the previous page, its items of the types ``shape`` names (ints
        within int64, strings without NUL); None for the first page."""
        if not token:
            return None
        if len(token) > MAX_TOKEN_CHARS:
            raise InvalidArgument(_MALFORMED, "page_token")
        try:
            raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        except ValueError:
            raise InvalidArgument(_MALFORMED, "page_token") from None
        signature, payload = raw[:_SIGNATURE_BYTES], raw[_SIGNATURE_BYTES:]
        if not hmac.compare_digest(signature, self._sign(payload)):
            raise InvalidArgument(
                "page_token: not issued by this registry (edited, made up, or from a registry "
                "with another database); pass next_page_token unchanged",
                "page_token",
            )
        try:
            decoded = json.loads(payload)
            key, hashed = decoded["k"], decoded["f"]
        except (ValueError, KeyError, TypeError, RecursionError):
            raise InvalidArgument(_MALFORMED, "page_token") from None
        if hashed != _filter_hash(filters):
            raise InvalidArgument(
                "page_token: was issued for other filters; send the same filters as the first page",
                "page_token",
            )
        if not _fits(key, shape):
            raise InvalidArgument(_MALFORMED, "page_token")
        return list(key)


def _fits(key: object, shape: Sequence[type]) -> bool:
    if not isinstance(key, list) or len(key) != len(shape):
        return False
    for item, kind in zip(key, shape, strict=True):
        if type(item) is not kind:  # bool is an int: exact types
            return False
        if isinstance(item, int) and not -_INT64 <= item < _INT64:
            return False
        if isinstance(item, str) and not (item.isprintable() and _encodable(item)):
            return False  # NUL and other controls, lone surrogates
    return True


def _encodable(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:  # a lone surrogate
        return False
    return True
