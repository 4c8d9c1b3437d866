"""``adapterctl``: the operators' command line for the registry.

    adapterctl base-model register PATH [--name N]
    adapterctl base-model list | show NAME
    adapterctl upload PATH --name N --base-model B [--alias A] [--description D] [--label k=v]...
    adapterctl list [--name N] [--base-model B] [--label k=v]... [--include-deleted] [--latest]
    adapterctl show REF
    adapterctl download REF -o DIR [--presigned]
    adapterctl alias set NAME ALIAS VERSION | alias rm NAME ALIAS
    adapterctl delete REF
    adapterctl gc [--grace-seconds N] [--dry-run]
    adapterctl watch [--name N] [--base-model B] [--after SEQUENCE]

Global options (before or after the command): --address (MOELORA_REGISTRY_ADDRESS),
--token (MOELORA_REGISTRY_TOKEN), --tls (MOELORA_REGISTRY_TLS=1), --ca-file
(MOELORA_REGISTRY_CA_FILE), --timeout, --json.

Exit codes: 0 ok, 1 other error, 2 usage, 3 not found, 4 invalid argument,
5 failed precondition or conflict (already exists), 6 unauthenticated or
permission denied, 7 unavailable or deadline exceeded, 8 too large (resource
exhausted), 9 data loss (checksum mismatch). Errors are one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from moelora.v1 import registry_pb2
from shared.errors import InvalidArgument, MoeLoraError
from shared.model_spec import read_model_spec
from shared.refs import validate_name
from shared.registry_client import RegistryClient, describe_folder

PROG = "adapterctl"
DEFAULT_ADDRESS = "127.0.0.1:50051"

EXIT_CODES = {
    grpc.StatusCode.NOT_FOUND: 3,
    grpc.StatusCode.INVALID_ARGUMENT: 4,
    grpc.StatusCode.OUT_OF_RANGE: 4,
    grpc.StatusCode.FAILED_PRECONDITION: 5,
    grpc.StatusCode.ALREADY_EXISTS: 5,
    grpc.StatusCode.ABORTED: 5,
    grpc.StatusCode.UNAUTHENTICATED: 6,
    grpc.StatusCode.PERMISSION_DENIED: 6,
    grpc.StatusCode.UNAVAILABLE: 7,
    grpc.StatusCode.DEADLINE_EXCEEDED: 7,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 8,
    grpc.StatusCode.DATA_LOSS: 9,
}


#: Smaller transfers take a blink: no bar.
_PROGRESS_MIN_BYTES = 4 * 1000**2


class Output:
    """Results on stdout (tables or JSON), progress and notes on stderr."""

    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json
        self.out = Console(highlight=False, soft_wrap=True)
        self.err = Console(stderr=True, highlight=False)

    def json(self, value: Any) -> None:
        print(json.dumps(value, indent=2, sort_keys=True))

    def message(self, message: Message) -> dict[str, Any]:
        return MessageToDict(message, preserving_proto_field_name=True)

    @contextmanager
    def progress(self, label: str, total: int) -> Iterator[Callable[[int], None]]:
        """A bar with bytes/s on stderr when it is a terminal and the transfer is over a few
        MB; silent otherwise."""
        bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=self.err,
            transient=True,
            disable=self.as_json or not self.err.is_terminal or total < _PROGRESS_MIN_BYTES,
        )
        with bar:
            task = bar.add_task(label, total=total)
            yield lambda n: bar.advance(task, n)


def _versions_table(versions: Sequence[registry_pb2.AdapterVersion]) -> Table:
    table = Table(box=None, pad_edge=False)
    for column in ("NAME", "VERSION", "STATUS", "BASE MODEL", "RANK", "SIZE", "ALIASES", "DIGEST"):
        table.add_column(column)
    for v in versions:
        table.add_row(
            v.name,
            str(v.version),
            registry_pb2.AdapterStatus.Name(v.status).removeprefix("ADAPTER_STATUS_"),
            v.base_model,
            str(v.rank),
            _size(v.size_bytes),
            ",".join(v.aliases),
            v.digest[:19],
        )
    return table


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _show_version(out: Output, v: registry_pb2.AdapterVersion) -> None:
    fields = out.message(v)
    if out.as_json:
        out.json(fields)
        return
    for key in (
        "name",
        "version",
        "digest",
        "status",
        "base_model",
        "base_model_fingerprint",
        "format",
        "rank",
        "lora_alpha",
        "use_rslora",
        "target_parameters",
        "layers",
        "dtype",
        "size_bytes",
        "aliases",
        "labels",
        "description",
        "created_by",
        "create_time",
        "delete_time",
    ):
        if key in fields:
            value = fields[key]
            text = ", ".join(map(str, value)) if isinstance(value, list) else value
            out.out.print(f"{key + ':':24} {text}")
    for f in v.files:
        # Piece digests (checked by executors as parts arrive): how many, not each one.
        pieces = (
            f"  {len(f.part_sha256)} pieces of {_size(f.part_size_bytes)} sha256-checked"
            if f.part_size_bytes
            else ""
        )
        out.out.print(f"{'file:':24} {f.path}  {_size(f.size_bytes)}  sha256:{f.sha256}{pieces}")


def _labels(pairs: Sequence[str]) -> dict[str, str]:
    labels = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise InvalidArgument(f"--label {pair!r}: use KEY=VALUE")
        labels[key] = value
    return labels


# -- commands ----------------------------------------------------------------------------------


def cmd_base_model_register(client: RegistryClient, args: argparse.Namespace, out: Output) -> None:
    folder = Path(args.path)
    name = validate_name(args.name or folder.resolve().name, "--name")
    response = client.register_base_model(read_model_spec(folder).to_proto(name))
    if out.as_json:
        out.json(
            {"created": response.created, "base_model": _base_model_dict(out, response.base_model)}
        )
        return
    bm = response.base_model
    verb = "registered" if response.created else "already registered (same fingerprint)"
    out.out.print(f"base model {bm.name} {verb}: {bm.model_type}, fingerprint {bm.fingerprint}")


def _base_model_dict(out: Output, message: Message) -> dict[str, Any]:
    fields = out.message(message)
    fields.pop("config_json", None)  # verbatim config.json: `show` prints it
    return fields


def cmd_base_model_list(client: RegistryClient, args: argparse.Namespace, out: Output) -> None:
    models = list(client.list_base_models())
    if out.as_json:
        out.json([_base_model_dict(out, m) for m in models])
        return
    table = Table(box=None, pad_edge=False)
    for column in ("NAME", "TYPE", "H", "I", "E", "TOP-K", "MOE LAYERS", "FINGERPRINT"):
        table.add_column(column)
    for m in models:
        table.add_row(
            m.name,
            m.model_type,
            str(m.hidden_size),
            str(m.moe_intermediate_size),
            str(m.num_experts),
            str(m.top_k),
            str(len(m.moe_layers)),
            m.fingerprint[:19],
        )
    out.out.print(table)


def cmd_base_model_show(client: RegistryClient, args: argparse.Namespace, out: Output) -> None:
    fields = out.message(client.get_base_model(args.name))
    if out.as_json:
        out.json(fields)
        return
    for key, value in fields.items():
        if key != "config_json":
            out.out.print(f"{key + ':':34} {value}")
    out.out.print("config_json:")
    out.out.print(fields.get("config_json", ""))


def cmd_upload(client: RegistryClient, args: argparse.Namespace, out: Output) -> None:
    folder = Path(args.path)
    total = sum(f.size_bytes for f in describe_folder(folder))
    with out.progress(f"upload {args.name}", total) as advance:
        version = client.upload(
            folder,
            args.name,
            args.base_model,
            alias=args.alias or "",
            description=args.description or "",
            labels=_labels(args.label),
            progress=advance,
            timeout=None,
        )
    if out.as_json:
        out.json(out.message(version))
    else:
        out.out.print(f"uploaded {version.name}:{version.version} {version.digest}")


def cmd_list(client: RegistryClient, args: argparse.Namespace, out: Output) -> None:
    versions = list(
        client.list_versions(
            name=args.name or "",
            base_model=args.base_model or "",
            labels=_labels(args.label),
            include_deleted=args.include_deleted,
            latest_only=args.latest,
        )
    )
    if out.as_json:
        out.json([out.message(v) for v in versions])
    else:
        out.out.print(_versions_table(versions))


def cmd_show(client: RegistryClient, args: argparse.Namespace, out: Output) -> None:
    _show_version(out, client.get(args.ref))


def cmd_download(client: RegistryClient, args: argparse.Namespace, out: Output) -> None:
    target = Path(args.output)
    version = client.get(args.ref)
    with out.progress(f"download {version.name}:{version.version}", version.size_bytes) as advance:
        pinned = f"{version.name}@{version.digest}"  # the version just shown, whatever moves
        if args.presigned:
            version = client.download_presigned(pinned, target, progress=advance)
        else:
            version = client.download(pinned, target, progress=advance)
    if out.as_json:
        out.json({"version": out.message(version), "directory": str(target)})
    else:
        out.out.print(f"downloaded {version.name}:{version.version} to {target} (sha256 verified)")


def cmd_alias_set(client: RegistryClient, args: argparse.Namespace, out: Output) -> None:
    response = client.set_alias(args.name, args.alias, args.version)
    if out.as_json:
        out.json(
            {
                "version": out.message(response.version),
                "previous_version": response.previous_version,
            }
        )
        return
    before = f" (was {response.previous_version})" if response.previous_version else ""
    out.out.print(f"{args.name}@{args.alias} -> {args.version}{before}")


def cmd_alias_rm(client: RegistryClient, args: argparse.Namespace, out: Output) -> None:
    previous = client.delete_alias(args.name, args.alias)
    if out.as_json:
        out.json({"previous_version": previous})
    else:
        out.out.print(f"removed {args.name}@{args.alias} (pointed at {previous})")


def cmd_delete(client: RegistryClient, args: argparse.Namespace, out: Output) -> None:
    version = client.delete(args.ref)
    if out.as_json:
        out.json(out.message(version))
    else:
        out.out.print(
            f"deleted {version.name}:{version.version}; still downloadable as "
            f"{version.name}@{version.digest} until gc"
        )


def cmd_gc(client: RegistryClient, args: argparse.Namespace, out: Output) -> None:
    report = client.gc(args.grace_seconds or 0, args.dry_run)
    if out.as_json:
        out.json(out.message(report) | {"dry_run": args.dry_run})
        return
    verb = "would remove" if args.dry_run else "removed"
    out.out.print(
        f"{verb} {len(report.removed_blobs)} blobs ({_size(report.removed_bytes)}), "
        f"purged {report.purged_versions} versions"
    )
    for key in report.removed_blobs:
        out.out.print(f"  {key}")


def cmd_watch(client: RegistryClient, args: argparse.Namespace, out: Output) -> None:
    with client.watch(
        name=args.name or "", base_model=args.base_model or "", after_sequence=args.after
    ) as stream:
        out.err.print(f"watching events after sequence {stream.start_sequence}")
        for event in stream:
            print(json.dumps(out.message(event), sort_keys=True), flush=True)


# -- parsing -----------------------------------------------------------------------------------


def _common(parser: argparse.ArgumentParser, *, top: bool) -> None:
    """Global options, accepted before and after the command."""
    env = os.environ

    def default(value: Any) -> Any:
        return value if top else argparse.SUPPRESS

    parser.add_argument(
        "--address",
        default=default(env.get("MOELORA_REGISTRY_ADDRESS", DEFAULT_ADDRESS)),
        help="registry host:port [env: MOELORA_REGISTRY_ADDRESS]",
    )
    parser.add_argument(
        "--token",
        default=default(env.get("MOELORA_REGISTRY_TOKEN")),
        help="bearer token [env: MOELORA_REGISTRY_TOKEN]",
    )
    parser.add_argument(
        "--tls",
        action="store_true",
        default=default(env.get("MOELORA_REGISTRY_TLS", "") in ("1", "true", "yes")),
        help="use TLS with the system roots [env: MOELORA_REGISTRY_TLS]",
    )
    parser.add_argument(
        "--ca-file",
        default=default(env.get("MOELORA_REGISTRY_CA_FILE")),
        help="PEM roots to trust; implies --tls [env: MOELORA_REGISTRY_CA_FILE]",
    )
    parser.add_argument(
        "--timeout", type=float, default=default(30.0), help="seconds per call (not transfers)"
    )
    parser.add_argument("--json", action="store_true", default=default(False), help="JSON output")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Manage adapters in a moe-lora-serve registry.",
        epilog="Exit codes: 0 ok, 1 other, 2 usage, 3 not found, 4 invalid argument, "
        "5 precondition/conflict, 6 auth, 7 unavailable, 8 too large, 9 data loss.",
    )
    _common(parser, top=True)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(sub: Any, name: str, handler: Callable[..., None], help_text: str) -> Any:
        p = sub.add_parser(name, help=help_text, description=help_text)
        _common(p, top=False)
        p.set_defaults(handler=handler)
        return p

    base = commands.add_parser("base-model", help="register and inspect base models")
    base_commands = base.add_subparsers(dest="base_command", required=True, metavar="COMMAND")
    p = add(
        base_commands,
        "register",
        cmd_base_model_register,
        "register a checkpoint folder (config.json + *.safetensors) as a base model",
    )
    p.add_argument("path")
    p.add_argument("--name", help="registry name; default: the folder's name")
    add(base_commands, "list", cmd_base_model_list, "list base models")
    p = add(base_commands, "show", cmd_base_model_show, "show one base model")
    p.add_argument("name")

    p = add(commands, "upload", cmd_upload, "upload an adapter folder as a new version")
    p.add_argument("path", help="folder with adapter_config.json and adapter_model.safetensors")
    p.add_argument("--name", required=True)
    p.add_argument("--base-model", required=True)
    p.add_argument("--alias", help="point NAME@ALIAS at the new version")
    p.add_argument("--description")
    p.add_argument("--label", action="append", default=[], metavar="KEY=VALUE")

    p = add(commands, "list", cmd_list, "list adapter versions")
    p.add_argument("--name")
    p.add_argument("--base-model")
    p.add_argument("--label", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--include-deleted", action="store_true")
    p.add_argument("--latest", action="store_true", help="only the newest version of each name")

    p = add(
        commands, "show", cmd_show, "show one version (name, name:V, name@alias, name@sha256:...)"
    )
    p.add_argument("ref")

    p = add(commands, "download", cmd_download, "download a version's files, sha256-verified")
    p.add_argument("ref")
    p.add_argument("-o", "--output", required=True, metavar="DIR")
    p.add_argument(
        "--presigned", action="store_true", help="fetch straight from S3 over presigned URLs"
    )

    alias = commands.add_parser("alias", help="move or remove NAME@ALIAS")
    alias_commands = alias.add_subparsers(dest="alias_command", required=True, metavar="COMMAND")
    p = add(alias_commands, "set", cmd_alias_set, "point NAME@ALIAS at VERSION")
    p.add_argument("name")
    p.add_argument("alias")
    p.add_argument("version", type=int)
    p = add(alias_commands, "rm", cmd_alias_rm, "remove NAME@ALIAS")
    p.add_argument("name")
    p.add_argument("alias")

    p = add(commands, "delete", cmd_delete, "soft-delete NAME:VERSION or NAME@sha256:HEX")
    p.add_argument("ref")

    p = add(commands, "gc", cmd_gc, "remove unreferenced blobs and purge deleted versions")
    p.add_argument("--grace-seconds", type=int, help="default: the server's gc_grace_seconds")
    p.add_argument("--dry-run", action="store_true")

    p = add(commands, "watch", cmd_watch, "print change events as JSON lines until interrupted")
    p.add_argument("--name")
    p.add_argument("--base-model")
    p.add_argument("--after", type=int, default=0, metavar="SEQUENCE")
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    out = Output(args.json)
    try:
        root_certificates = Path(args.ca_file).read_bytes() if args.ca_file else None
        with RegistryClient(
            args.address,
            token=args.token,
            tls=args.tls,
            root_certificates=root_certificates,
            timeout=args.timeout,
        ) as client:
            args.handler(client, args, out)
    except MoeLoraError as exc:
        code = EXIT_CODES.get(exc.code, 1)
        print(f"{PROG}: {exc.code.name}: {exc.message}", file=sys.stderr)
        raise SystemExit(code) from None
    except OSError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
