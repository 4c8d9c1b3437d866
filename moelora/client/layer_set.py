"""Layer sets as operators write them: ``"0-23,30,40-47"`` ↔ a sorted tuple of layer indices.

Used by ``--layers`` (which MoE layers an executor serves), by GetExecutorInfo's
``served_layers`` readers and by error messages that name layers.
"""

from __future__ import annotations

from collections.abc import Iterable

from moelora.client.errors import InvalidArgument


def parse_layers(text: str, field: str = "layers") -> tuple[int, ...]:
    """``"0-3,7"`` -> (0, 1, 2, 3, 7). Ranges are inclusive; spaces are ignored; duplicates
    merge. Raises InvalidArgument naming ``field`` for anything else (empty parts, negative
    numbers, reversed ranges)."""
    layers: set[int] = set()
    for raw in text.replace(" ", "").split(","):
        if not raw:
            raise InvalidArgument(f"{field}: {text!r} has an empty part", field)
        low, sep, high = raw.partition("-")
        try:
            start = int(low)
            end = int(high) if sep else start
        except ValueError:
            raise InvalidArgument(
                f"{field}: {raw!r} in {text!r} is not N or N-M (for example 0-23,30)", field
            ) from None
        if start < 0 or end < start:
            raise InvalidArgument(
                f"{field}: {raw!r} in {text!r} is not a range of non-negative layers", field
            )
        layers.update(range(start, end + 1))
    return tuple(sorted(layers))


def format_layers(layers: Iterable[int]) -> str:
    """(0, 1, 2, 3, 7) -> ``"0-3,7"``; the inverse of ``parse_layers``."""
    parts: list[str] = []
    ordered = sorted(set(layers))
    start = 0
    for index, value in enumerate(ordered):
        last = index + 1 == len(ordered) or ordered[index + 1] != value + 1
        if last:
            first = ordered[start]
            parts.append(f"{first}-{value}" if first != value else f"{value}")
            start = index + 1
    return ",".join(parts)
