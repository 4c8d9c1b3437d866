"""Start-up that fails loudly: a service that cannot start says so in one line on stderr
(what failed, the setting, the fix) and exits 1, before it takes any traffic.

Invalid settings exit 2 earlier (shared/config.py); what only shows once the service acts on
its settings (an address already in use, a missing checkpoint, a database that refuses) comes
through here."""

from __future__ import annotations

import contextlib
import errno
import socket
import sys
from collections.abc import Iterator

from moelora.client.errors import MoeLoraError
from shared.config import ServiceSettings


class StartupError(Exception):
    """Why a service cannot start, as one line: ``what (setting): fix``; ``exit_code`` 2 for a
    setting that is invalid in itself (as pydantic's refusals exit), 1 for one the service
    could not act on."""

    def __init__(self, what: str, setting: str = "", fix: str = "", exit_code: int = 1) -> None:
        self.what = what
        self.setting = setting
        self.fix = fix
        self.exit_code = exit_code
        super().__init__(str(self))

    def __str__(self) -> str:
        line = self.what
        if self.setting:
            line += f" ({self.setting})"
        return f"{line}; {self.fix}" if self.fix else line


def setting_name(settings: type[ServiceSettings], field: str) -> str:
    """``--field-name / ENV_NAME``: how an operator sets ``field``."""
    return f"--{field.replace('_', '-')} / {settings.env_names()[field]}"


def concrete_listen(listen: str) -> str:
    """``host:port`` with port 0 replaced by a port free now (several processes that share
    one port must agree on it before they bind)."""
    host, _, port = listen.rpartition(":")
    if int(port) != 0:
        return listen
    address = host.strip("[]") or "0.0.0.0"
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((address, 0))
        return f"{host}:{probe.getsockname()[1]}"


def check_listen(listen: str, setting: str) -> None:
    """Raises StartupError unless ``host:port`` can be bound now (empty or port 0: nothing
    to check). gRPC's own bind failure names no cause and prints a C++ log line; this names
    it and the way out."""
    if not listen:
        return
    host, colon, port = listen.rpartition(":")
    if not colon or not port.isdigit() or int(port) > 65535:
        raise StartupError(
            f"{listen!r} is not host:port", setting, "e.g. 0.0.0.0:50051", exit_code=2
        )
    if int(port) == 0:
        return
    host = host.strip("[]") or "0.0.0.0"
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        raise StartupError(
            f"cannot listen on {listen}: {host!r} does not resolve ({exc.strerror})",
            setting,
            "use an address of this host, or 0.0.0.0 for every interface",
        ) from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds
        try:
            probe.bind(address)
        except OSError as exc:
            what = f"cannot listen on {listen}: {_why(exc)}"
            raise StartupError(what, setting, _fix(exc)) from None


def _why(exc: OSError) -> str:
    return {
        errno.EADDRINUSE: "the address is already in use",
        errno.EACCES: "permission denied",
        errno.EADDRNOTAVAIL: "that is not an address of this host",
    }.get(exc.errno or 0, exc.strerror or str(exc))


def _fix(exc: OSError) -> str:
    return {
        errno.EADDRINUSE: "stop the process that holds it, or choose another port",
        errno.EACCES: "choose a port above 1023, or run with the privilege to bind low ports",
        errno.EADDRNOTAVAIL: "use an address of this host, or 0.0.0.0 for every interface",
    }.get(exc.errno or 0, "")


@contextlib.contextmanager
def exit_on_startup_error(prog: str, *also: type[BaseException]) -> Iterator[None]:
    """Turns StartupError, and the errors a service's parts raise for bad settings or
    unreachable dependencies (ValueError, OSError, MoeLoraError, and ``also``), into one
    line on stderr and exit status 1 (a StartupError's own status where it says)."""
    caught: tuple[type[BaseException], ...] = (StartupError, ValueError, OSError, MoeLoraError)
    try:
        yield
    except (*caught, *also) as exc:
        text = " ".join(str(exc).split()) or type(exc).__name__
        print(f"{prog}: {text}", file=sys.stderr, flush=True)
        raise SystemExit(exc.exit_code if isinstance(exc, StartupError) else 1) from None
