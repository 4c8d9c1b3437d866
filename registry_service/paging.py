"""Where page tokens are made and read. A token is opaque to clients: URL-safe
base64 of JSON holding the last key of the page and a hash of the filters, so
a token sent with other filters is refused instead of silently skipping rows."""

from __future__ import annotations

import base64
import hashlib
import json
from typing import Any

from moelora.client.errors import InvalidArgument

DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000


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


def encode_token(last_key: list[Any], filters: Any) -> str:
    payload = json.dumps({"k": last_key, "f": _filter_hash(filters)}, separators=(",", ":"))
    return base64.urlsafe_b64encode(payload.encode()).decode().rstrip("=")


def decode_token(token: str, filters: Any) -> list[Any] | None:
    """The last key of the previous page; None for the first page."""
    if not token:
        return None
    try:
        raw = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
        key, hashed = raw["k"], raw["f"]
        if not isinstance(key, list):
            raise TypeError("key")
    except (ValueError, KeyError, TypeError):
        raise InvalidArgument(
            "page_token: malformed; pass next_page_token unchanged", "page_token"
        ) from None
    if hashed != _filter_hash(filters):
        raise InvalidArgument(
            "page_token: was issued for other filters; send the same filters as the first page",
            "page_token",
        )
    return key
