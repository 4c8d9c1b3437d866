"""Typed, checked access to the fields of untrusted JSON documents (config.json,
adapter_config.json): every error names the document and the field."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from moelora.client.errors import InvalidArgument


def parse_json_object(data: bytes, where: str) -> dict[str, Any]:
    """``data`` as a JSON object; ``where`` names the document in errors."""
    try:
        parsed = json.loads(data)
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise InvalidArgument(f"{where} is not valid JSON: {err}") from None
    if not isinstance(parsed, dict):
        raise InvalidArgument(f"{where} is not a JSON object")
    return parsed


class JsonFields:
    """Reads fields of one JSON object. A field that is absent or null takes the default;
    without a default it is required."""

    def __init__(self, document: Mapping[str, Any], where: str) -> None:
        self._document = document
        self._where = where

    def has(self, key: str) -> bool:
        return self._document.get(key) is not None

    def _value(self, key: str, default: object) -> object:
        value = self._document.get(key)
        if value is None:
            if default is None:
                raise InvalidArgument(f"{self._where} lacks {key}")
            return default
        return value

    def integer(self, key: str, default: int | None = None) -> int:
        value = self._value(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise InvalidArgument(
                f"{self._where} {key} must be a non-negative integer, got {value!r}"
            )
        return value

    def number(self, key: str, default: float | None = None) -> float:
        value = self._value(key, default)
        if (
            not isinstance(value, int | float)
            or isinstance(value, bool)
            or not math.isfinite(value)
        ):
            raise InvalidArgument(f"{self._where} {key} must be a finite number, got {value!r}")
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self._value(key, default)
        if not isinstance(value, bool):
            raise InvalidArgument(f"{self._where} {key} must be true or false, got {value!r}")
        return value

    def integer_list(self, key: str, default: list[int]) -> list[int]:
        value = self._value(key, default)
        if not isinstance(value, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in value
        ):
            raise InvalidArgument(f"{self._where} {key} must be a list of integers, got {value!r}")
        return value

    def string_list(self, key: str) -> list[str]:
        """A list of strings; absent or null is the empty list."""
        value = self._value(key, [])
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise InvalidArgument(f"{self._where} {key} must be a list of strings, got {value!r}")
        return value

    def mapping(self, key: str) -> dict[str, Any]:
        """A JSON object; absent or null is the empty object."""
        value = self._value(key, {})
        if not isinstance(value, dict):
            raise InvalidArgument(f"{self._where} {key} must be an object, got {value!r}")
        return value
