"""``moelora-registry [COMMAND] [OPTIONS]``: the registry server and its operator commands.
Settings are flags with MOELORA_REGISTRY_* twins; ``moelora-registry COMMAND --help`` lists
them.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from prometheus_client import REGISTRY
from sqlalchemy.exc import OperationalError, SQLAlchemyError

from moelora.client.logs import configure_logging
from registry_service.app import open_database, open_registry
from registry_service.backfill import backfill_parts
from registry_service.config import RegistrySettings
from registry_service.db import migrate
from registry_service.metrics import InventoryCollector
from registry_service.server import create_server
from shared.config import parse_settings
from shared.metrics import start_metrics_server
from shared.startup import StartupError, check_listen, exit_on_startup_error, setting_name
from shared.tokens import Role, new_token_entry

#: Each command and what it does (its --help says it too).
COMMANDS = {
    "serve": "run the gRPC server (the default command)",
    "migrate": "bring the database schema up to date; idempotent, exits 0",
    "gc": "remove unreferenced blobs and dead versions without a server (--grace-seconds N, "
    "--dry-run)",
    "backfill-parts": "record per-piece sha256s (--part-size-bytes) for versions uploaded "
    "before the registry did; exits 1 if a blob failed its sha256",
    "hash-token": "make a random token for a name and role (read, write, admin) and print it "
    "with its token-file entry",
}
_GC_OPTIONS = """gc's own options:
  --grace-seconds N   spare unreferenced blobs younger than N seconds (default: the
                      gc_grace_seconds setting)
  --dry-run           say what would go, remove nothing"""


def usage() -> str:
    """``moelora-registry --help``: the commands, each with its own --help."""
    width = max(map(len, COMMANDS))
    lines = [
        "usage: moelora-registry [COMMAND] [OPTIONS]",
        "",
        "The moe-lora-serve adapter registry.",
        "",
        "commands:",
        *(f"  {name:{width}}  {text}" for name, text in COMMANDS.items()),
        "",
        "Without a command, serve. Options are the registry's settings (flags with "
        "MOELORA_REGISTRY_* environment twins): moelora-registry COMMAND --help lists them.",
    ]
    return "\n".join(lines)


def serve(settings: RegistrySettings) -> None:
    for field in ("listen", "metrics_listen", "http_listen"):
        check_listen(getattr(settings, field), setting_name(RegistrySettings, field))
    app = open_registry(settings)
    server = create_server(app, settings)
    REGISTRY.register(InventoryCollector(app.registry.store.inventory))
    start_metrics_server(settings.metrics_listen)
    server.set_serving(True)
    server.serve_forever(on_drained=app.close)


def run_migrate(settings: RegistrySettings) -> None:
    db = open_database(settings)
    try:
        revision = migrate.upgrade(db)
    finally:
        db.dispose()
    print(json.dumps({"database": db.safe_url, "revision": revision}))


def run_gc(settings: RegistrySettings, grace_seconds: int | None, dry_run: bool) -> None:
    app = open_registry(settings, background=False)
    try:
        report = app.registry.gc(grace_seconds, dry_run)
    finally:
        app.close()
    print(
        json.dumps(
            {
                "dry_run": dry_run,
                "removed_blobs": report.removed_blobs,
                "removed_bytes": report.removed_bytes,
                "purged_versions": report.purged_versions,
            }
        )
    )


def run_backfill(settings: RegistrySettings) -> None:
    app = open_registry(settings, background=False)
    try:
        report = backfill_parts(app.db, app.registry.blobs, settings.part_size_bytes)
    finally:
        app.close()
    print(
        json.dumps(
            {
                "part_size_bytes": settings.part_size_bytes,
                "filled": report.filled,
                "failed": report.failed,
            }
        )
    )
    if report.failed:
        raise SystemExit(1)


def hash_token(args: Sequence[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="moelora-registry hash-token",
        description="Print a new random token (give it to the client) and its entry for "
        "the tokens file (give that to the registry).",
    )
    parser.add_argument("name", help="who the token is for; recorded as created_by")
    parser.add_argument("role", choices=["read", "write", "admin"])
    parser.add_argument(
        "--fleet",
        action="store_true",
        help="the token the executor fleet presents: its watches are not capped per token",
    )
    ns = parser.parse_args(args)
    token, entry = new_token_entry(ns.name, Role.parse(ns.role), fleet=ns.fleet)
    print(json.dumps({"token": token, "entry": entry}))


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help"):
        print(usage())
        return
    command = args.pop(0) if args and args[0] in COMMANDS else "serve"
    if command == "hash-token":
        hash_token(args)
        return
    grace: int | None = None
    dry_run = False
    if command == "gc":
        gc_parser = argparse.ArgumentParser(prog="moelora-registry gc", add_help=False)
        gc_parser.add_argument("--grace-seconds", type=int)
        gc_parser.add_argument("--dry-run", action="store_true")
        gc_args, args = gc_parser.parse_known_args(args)
        grace, dry_run = gc_args.grace_seconds, gc_args.dry_run
    description = COMMANDS[command] + (f"\n\n{_GC_OPTIONS}" if command == "gc" else "")
    settings = parse_settings(
        RegistrySettings, args, prog=f"moelora-registry {command}", description=description
    )
    configure_logging(settings.log_level, settings.log_format)
    with exit_on_startup_error(f"moelora-registry {command}", SQLAlchemyError):
        try:
            if command == "serve":
                serve(settings)
            elif command == "migrate":
                run_migrate(settings)
            elif command == "backfill-parts":
                run_backfill(settings)
            else:
                run_gc(settings, grace, dry_run)
        except OperationalError as exc:  # the database refused or could not be reached
            raise StartupError(
                f"cannot use the database: {exc.orig}",
                setting_name(RegistrySettings, "database_url"),
                "check the URL, its credentials, and that the database accepts connections",
            ) from None


if __name__ == "__main__":
    main()
