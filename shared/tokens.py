"""Who may call what: bearer tokens with roles, the one format both services accept.

The token file is JSON, tokens stored only as SHA-256 hex::

    {"tokens": [{"name": "ci", "role": "write", "sha256": "<64 hex>"},
                {"name": "executors", "role": "read", "sha256": "<64 hex>", "fleet": true}]}

``moelora-registry hash-token NAME ROLE [--fleet]`` makes a random token and its entry.
``fleet`` marks the token the executor fleet presents to the registry: its WatchAdapters
streams are not capped per token and may use the watch capacity other readers may not.
Roles are ordered read < write < admin; a call needs at least the role its
RPC names (each service's table). The file is re-read when it changes, so a
token can be added or revoked without a restart (a Kubernetes Secret update).
"""

from __future__ import annotations

import enum
import hashlib
import ipaddress
import json
import logging
import re
import secrets
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moelora.client.auth import bearer_token
from moelora.client.errors import MoeLoraError, PermissionDenied, Unauthenticated
from moelora.client.logs import log_event

log = logging.getLogger(__name__)

_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_TOKEN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,127}")
_RELOAD_CHECK_SECONDS = 2.0


class Role(enum.IntEnum):
    READ = 1
    WRITE = 2
    ADMIN = 3

    @classmethod
    def parse(cls, text: str) -> Role:
        try:
            return cls[text.upper()]
        except KeyError:
            raise ValueError(f"unknown role {text!r}: use read, write or admin") from None


@dataclass(frozen=True)
class Principal:
    """Who is calling: the token's name (recorded as created_by) and role, and the token's
    digest ("" while auth is off)."""

    name: str
    role: Role
    token_sha256: str = ""
    #: The executor fleet's token (see the module docstring).
    fleet: bool = False

    @property
    def has_token(self) -> bool:
        return bool(self.token_sha256)


EMBEDDED = Principal("embedded", Role.ADMIN)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def new_token_entry(name: str, role: Role, fleet: bool = False) -> tuple[str, dict[str, Any]]:
    """A fresh random token and its token-file entry."""
    if not _TOKEN_NAME.fullmatch(name):
        raise ValueError(f"token name {name!r}: use 1-128 of A-Z a-z 0-9 . _ @ -")
    token = secrets.token_urlsafe(32)
    entry: dict[str, Any] = {"name": name, "role": role.name.lower(), "sha256": hash_token(token)}
    if fleet:
        entry["fleet"] = True
    return token, entry


def parse_token_file(text: str, where: str) -> dict[str, Principal]:
    """sha256 hex -> principal; ValueError naming the entry that is wrong."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not valid JSON: {exc}") from None
    entries = raw.get("tokens") if isinstance(raw, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f'{where}: expected {{"tokens": [{{"name", "role", "sha256"}}, ...]}}')
    table: dict[str, Principal] = {}
    names: set[str] = set()
    for i, entry in enumerate(entries):
        at = f"{where}: tokens[{i}]"
        if not isinstance(entry, dict) or not {"name", "role", "sha256"} <= set(entry) <= {
            "name",
            "role",
            "sha256",
            "fleet",
        }:
            raise ValueError(f"{at}: needs the keys name, role, sha256 (and may say fleet)")
        name, role, digest = entry["name"], entry["role"], entry["sha256"]
        fleet = entry.get("fleet", False)
        if not isinstance(fleet, bool):
            raise ValueError(f"{at}: fleet must be true or false")
        if not isinstance(name, str) or not _TOKEN_NAME.fullmatch(name) or name in names:
            raise ValueError(f"{at}: name {name!r} is invalid or repeated")
        if not isinstance(digest, str) or not _SHA256_HEX.fullmatch(digest) or digest in table:
            raise ValueError(f"{at}: sha256 must be 64 lower-case hex digits, once per file")
        table[digest] = Principal(name, Role.parse(str(role)), digest, fleet)
        names.add(name)
    return table


class TokenFile:
    """The token table of one file, re-read when the file changes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._stamp = self._stat()
        self._table = parse_token_file(path.read_text(), str(path))
        self._checked = time.monotonic()

    def _stat(self) -> tuple[int, int]:
        st = self.path.stat()
        return st.st_mtime_ns, st.st_size

    def table(self) -> Mapping[str, Principal]:
        with self._lock:
            now = time.monotonic()
            if now - self._checked >= _RELOAD_CHECK_SECONDS:
                self._checked = now
                self._reload_if_changed()
            return self._table

    def _reload_if_changed(self) -> None:
        try:
            stamp = self._stat()
            if stamp == self._stamp:
                return
            self._table = parse_token_file(self.path.read_text(), str(self.path))
            self._stamp = stamp
            log_event(log, "auth_tokens_reloaded", path=str(self.path), tokens=len(self._table))
        except (OSError, ValueError) as exc:
            # Keep serving with the tokens we had rather than locking everyone out.
            log_event(log, "auth_tokens_reload_failed", logging.ERROR, error=str(exc))


class TokenChecker:
    """Checks a call's metadata against the token file; with no file (auth off)
    every caller is the ``embedded`` admin. ``hint`` tells a caller without a
    token where its client takes one."""

    def __init__(self, tokens: TokenFile | None, hint: str) -> None:
        self._tokens = tokens
        self._hint = hint

    @property
    def enabled(self) -> bool:
        return self._tokens is not None

    def identify(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> Principal:
        """Who the metadata's token belongs to (``EMBEDDED`` while auth is off)."""
        if self._tokens is None:
            return EMBEDDED
        token = bearer_token(metadata)
        if token is None:
            raise Unauthenticated(
                f"missing bearer token: send 'authorization: Bearer <token>' ({self._hint})"
            )
        principal = self._tokens.table().get(hash_token(token))
        if principal is None:
            raise Unauthenticated("unknown or revoked bearer token")
        return principal

    def require(self, metadata: Iterable[tuple[str, str | bytes]] | None, role: Role) -> Principal:
        principal = self.identify(metadata)
        _check_role(principal, role)
        return principal

    def recheck(self, principal: Principal, role: Role) -> MoeLoraError | None:
        """Whether ``principal``'s token still holds ``role`` in the current token file: the
        error that ends its calls, or None."""
        if self._tokens is None or not principal.has_token:
            return None
        current = self._tokens.table().get(principal.token_sha256)
        if current is None:
            return Unauthenticated(f"token {principal.name!r} was revoked")
        try:
            _check_role(current, role)
        except PermissionDenied as exc:
            return exc
        return None


def _check_role(principal: Principal, role: Role) -> None:
    if principal.role < role:
        raise PermissionDenied(
            f"token {principal.name!r} has role {principal.role.name.lower()}; "
            f"this call needs {role.name.lower()}"
        )


def method_roles(service: Any, roles_by_name: Mapping[str, Role]) -> dict[str, Role]:
    """Full method name -> least role for the methods of ``service`` (a protobuf service
    descriptor) that ``roles_by_name`` names; a method left out is open to no role."""
    return {
        f"/{service.full_name}/{m.name}": roles_by_name[m.name]
        for m in service.methods
        if m.name in roles_by_name
    }


class MethodAuthorizer:
    """The gRPC server's auth hook (``shared.call_limits.CallAuthorizer``): a call's token must
    hold the role ``roles`` names for its method; a method missing there is refused."""

    def __init__(self, checker: TokenChecker, roles: Mapping[str, Role]) -> None:
        self.checker = checker
        self._roles = roles

    def _role(self, method: str) -> Role:
        role = self._roles.get(method)
        if role is None:
            raise PermissionDenied(f"{method} is not open to any role")
        return role

    def authorize(self, method: str, metadata: Sequence[tuple[str, str | bytes]]) -> Principal:
        return self.checker.require(metadata, self._role(method))

    def still_authorized(self, method: str, caller: object) -> MoeLoraError | None:
        assert isinstance(caller, Principal)
        return self.checker.recheck(caller, self._role(method))


def is_loopback(listen: str) -> bool:
    host = listen.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def auth_required(mode: str, listen: str, local: bool = True) -> bool:
    """``auto`` is off only on loopback, and only when ``local`` (the registry's embedded
    storage; always true for the executor)."""
    if mode == "auto":
        return not (is_loopback(listen) and local)
    return mode == "on"


def open_token_checker(
    mode: str,
    listen: str,
    tokens_file: Path | None,
    *,
    local: bool,
    hint: str,
    auto_on_when: str = "off loopback",
) -> TokenChecker:
    """Auth as a service's settings ask; refuses auth without a token file.
    ``auto_on_when`` says, in the refusal, when ``auto`` turns auth on."""
    if not auth_required(mode, listen, local):
        return TokenChecker(None, hint)
    if tokens_file is None:
        why = "auth=on" if mode == "on" else f"auth=auto {auto_on_when}"
        raise ValueError(
            f"{why} needs --auth-tokens-file / MOELORA_AUTH_TOKENS_FILE "
            "(make entries with `moelora-registry hash-token NAME ROLE`), or --auth off"
        )
    return TokenChecker(TokenFile(tokens_file.expanduser()), hint)
