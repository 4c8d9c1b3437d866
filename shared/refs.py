"""Names and adapter references, as registry.proto defines them.

name                the newest READY version
name:VERSION        one version
name@ALIAS          the version an alias points at
name@sha256:HEX     the version with that digest (also after a soft delete)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from moelora.client.errors import InvalidArgument, quoted

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_ALIAS = re.compile(r"[A-Za-z][A-Za-z0-9._-]{0,63}")
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


def validate_name(name: str, field: str = "name") -> str:
    """Returns ``name`` if it is a valid adapter or base-model name, else raises
    InvalidArgument saying why (``..``, ``/`` and control characters never pass)."""
    if not name:
        raise InvalidArgument(f"{field}: must not be empty", field)
    if not _NAME.fullmatch(name) or ".." in name:
        raise InvalidArgument(
            f"{field}: {quoted(name)} is not a valid name: use 1-128 characters of "
            "A-Z a-z 0-9 . _ -, starting with a letter or digit, without '..'",
            field,
        )
    return name


def validate_alias(alias: str, field: str = "alias") -> str:
    """Returns ``alias`` if valid; aliases start with a letter so that they never
    look like a version number."""
    if not _ALIAS.fullmatch(alias) or ".." in alias or alias.startswith("sha256"):
        raise InvalidArgument(
            f"{field}: {quoted(alias)} is not a valid alias: use 1-64 characters of "
            "A-Z a-z 0-9 . _ -, starting with a letter, not 'sha256'",
            field,
        )
    return alias


def validate_digest(digest: str, field: str = "digest") -> str:
    if not _DIGEST.fullmatch(digest):
        raise InvalidArgument(
            f"{field}: {quoted(digest)} is not 'sha256:' + 64 lower-case hex", field
        )
    return digest


@dataclass(frozen=True)
class AdapterRef:
    """A parsed adapter reference; at most one of version, alias, digest is set."""

    name: str
    version: int | None = None
    alias: str | None = None
    digest: str | None = None

    @classmethod
    def parse(cls, text: str, field: str = "ref") -> AdapterRef:
        text = text.strip()
        if "@" in text:
            name, _, selector = text.partition("@")
            validate_name(name, field)
            if selector.startswith("sha256:"):
                return cls(name, digest=validate_digest(selector, field))
            return cls(name, alias=validate_alias(selector, field))
        if ":" in text:
            name, _, version = text.partition(":")
            validate_name(name, field)
            # ASCII only: str.isdigit() also accepts "²" and "٣", which int() refuses or reads.
            valid = version.isascii() and version.isdigit() and len(version) <= 9
            if not valid or int(version) < 1:
                raise InvalidArgument(
                    f"{field}: version in {quoted(text)} must be a positive integer", field
                )
            return cls(name, version=int(version))
        return cls(validate_name(text, field))

    @property
    def is_pinned_version(self) -> bool:
        """True when the reference names one immutable version (number or digest)."""
        return self.version is not None or self.digest is not None

    def __str__(self) -> str:
        if self.version is not None:
            return f"{self.name}:{self.version}"
        if self.alias is not None:
            return f"{self.name}@{self.alias}"
        if self.digest is not None:
            return f"{self.name}@{self.digest}"
        return self.name
