"""HTTP ``Range`` headers (RFC 9110 section 14) as the blob server answers them.

One range per request, as every parallel downloader sends (s3transfer, hf_transfer, the
executor): ``bytes=FIRST-LAST``, ``bytes=FIRST-`` or ``bytes=-SUFFIX``. A header in another unit
is ignored (the RFC says it must be: the whole blob is sent). Anything else the server will not
serve, a set of several ranges or a malformed one included, is refused with 416 like a range
beyond the end, rather than answered with the whole blob (a gigabyte the client did not ask for).
"""

from __future__ import annotations

import re

from moelora.client.errors import quoted

# ASCII digits only (str.isdigit and \d take "²" and "٣"), at most 19 (int64).
_ONE_RANGE = re.compile(r"([0-9]{0,19})-([0-9]{0,19})")
#: Longer headers are refused unread (a real one is "bytes=" and two numbers).
_MAX_HEADER_CHARS = 200


class RangeNotSatisfiable(Exception):
    """A Range header the server refuses (416); the message says why."""


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """The byte range ``[begin, end)`` of a ``size``-byte blob that ``header`` asks for, or
    None for the whole blob (no header, or another unit than bytes)."""
    if header is None:
        return None
    if len(header) > _MAX_HEADER_CHARS:
        raise RangeNotSatisfiable(
            f"unsupported Range {quoted(header, 40)}: send one range, bytes=FIRST-LAST"
        )
    unit, sep, spec = header.strip().partition("=")
    if not sep or unit.strip().lower() != "bytes":
        return None
    match = _ONE_RANGE.fullmatch(spec.strip())
    if match is None:
        raise RangeNotSatisfiable(f"unsupported Range {header!r}: send one range, bytes=FIRST-LAST")
    first, last = match.groups()
    if first:
        begin = int(first)
        end = size if not last else int(last) + 1
        if last and end <= begin:
            raise RangeNotSatisfiable(f"Range {header!r}: the last byte is before the first")
        if begin >= size:
            raise RangeNotSatisfiable(
                f"Range {header!r} starts at or beyond the blob's {size} bytes"
            )
        return begin, min(end, size)
    if not last:
        raise RangeNotSatisfiable(f"Range {header!r} names no byte")
    suffix = int(last)
    if suffix == 0 or size == 0:
        raise RangeNotSatisfiable(f"Range {header!r} selects none of the blob's {size} bytes")
    return max(0, size - suffix), size
