"""``adapterctl``: the operators' command line for the registry, made for people and scripts.

    adapterctl base-model register PATH [--name N]
    adapterctl base-model list | show NAME
    adapterctl upload PATH --name N --base-model B [--alias A] [--description D] [--label k=v]...
                     [--allow-duplicate]
    adapterctl list [--name N] [--base-model B] [--label k=v]... [--include-deleted] [--latest]
    adapterctl get REF                    (also: show REF)
    adapterctl download REF DIR [--presigned]
    adapterctl alias set NAME ALIAS VERSION | alias rm NAME ALIAS
    adapterctl delete REF [--force]
    adapterctl gc [--grace-seconds N] [--dry-run]
    adapterctl watch [--name N] [--base-model B] [--after SEQUENCE]
    adapterctl completion bash|zsh|tcsh
    adapterctl --version

Global options (before or after the command): --address (MOELORA_REGISTRY_ADDRESS),
--token (MOELORA_REGISTRY_TOKEN), --tls (MOELORA_REGISTRY_TLS=1), --ca-file
(MOELORA_REGISTRY_CA_FILE), --timeout, -o/--output table|wide|name|json|yaml (--json is
-o json). Output conventions: ``registry_service/cli/output.py``.

Exit codes: 0 ok, 1 other error, 2 usage, 3 not found, 4 invalid argument,
5 failed precondition or conflict (already exists; a delete an alias guards), 6
unauthenticated or permission denied, 7 unavailable or deadline exceeded, 8 too large
(resource exhausted), 9 data loss (checksum mismatch), 141 stdout closed (``| head``).
Errors are one line on stderr, a JSON object with -o json or yaml.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import grpc
import shtab
from google.protobuf.message import Message

from moelora.client.adapter_files import ADAPTER_FILES, files_digest
from moelora.client.errors import FailedPrecondition, InvalidArgument, MoeLoraError
from moelora.client.model_spec import read_model_spec
from moelora.client.registry import RegistryClient, describe_folder
from moelora.v1 import registry_pb2
from registry_service.cli.output import (
    FORMATS,
    Output,
    fields_text,
    message_dict,
    render_table,
    size_text,
)
from shared.refs import AdapterRef, validate_name
from shared.version import package_version

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
#: 128 + SIGPIPE, as a shell reports a process a closed pipe ended.
EXIT_BROKEN_PIPE = 141

_VERSION_COLUMNS = ("NAME", "VERSION", "STATUS", "BASE-MODEL", "RANK", "SIZE", "ALIASES", "DIGEST")
_WIDE_COLUMNS = ("FORMAT", "LAYERS", "LABELS", "CREATED", "CREATED-BY")


def _ref(v: registry_pb2.AdapterVersion) -> str:
    return f"{v.name}:{v.version}"


def _versions_table(
    versions: Sequence[registry_pb2.AdapterVersion], wide: bool, full_digest: bool
) -> str:
    rows = []
    for v in versions:
        fields = message_dict(v)
        row = [
            v.name,
            str(v.version),
            fields["status"],
            v.base_model,
            str(v.rank),
            size_text(v.size_bytes),
            ",".join(v.aliases),
            v.digest if full_digest or wide else v.digest[:19],
        ]
        if wide:
            row += [
                fields["format"],
                str(len(v.layers)),
                ",".join(f"{k}={x}" for k, x in sorted(v.labels.items())),
                fields["create_time"] or "",
                v.created_by,
            ]
        rows.append(row)
    headers = _VERSION_COLUMNS + (_WIDE_COLUMNS if wide else ())
    return render_table(headers, rows)


def _show_version(out: Output, v: registry_pb2.AdapterVersion) -> None:
    fields = message_dict(v)

    def human(wide: bool) -> str:
        shown = {k: x for k, x in fields.items() if k != "files" and x not in (None, "", [], {})}
        lines = [fields_text(shown)]
        for f in v.files:
            # Piece digests (checked by executors as parts arrive): how many, not each one.
            pieces = (
                f"  {len(f.part_sha256)} pieces of {size_text(f.part_size_bytes)} sha256-checked"
                if f.part_size_bytes
                else ""
            )
            lines.append(
                f"{'file:':24} {f.path}  {size_text(f.size_bytes)}  sha256:{f.sha256}{pieces}"
            )
        return "\n".join(lines)

    out.emit(fields, human, [_ref(v)])


def _labels(pairs: Sequence[str]) -> dict[str, str]:
    labels = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise InvalidArgument(f"--label {pair!r}: use KEY=VALUE")
        labels[key] = value
    return labels


def _folder(path: str) -> Path:
    """The adapter or checkpoint folder ``path``, or an error that names it."""
    folder = Path(path)
    if not folder.is_dir():
        what = "is not a folder" if folder.exists() else "does not exist"
        raise InvalidArgument(f"{path} {what}: give the folder that holds the files")
    return folder


# -- commands ----------------------------------------------------------------------------------


def cmd_base_model_register(client: RegistryClient, args: argparse.Namespace, out: Output) -> None:
    folder = _folder(args.path)
    name = validate_name(args.name or folder.resolve().name, "--name")
    response = client.register_base_model(read_model_spec(folder).to_proto(name))
    bm = response.base_model
    verb = "registered" if response.created else "already registered (same fingerprint)"
    out.emit(
        {"created": response.created, "base_model": _base_model_dict(bm)},
        lambda wide: f"base model {bm.name} {verb}: {bm.model_type}, fingerprint {bm.fingerprint}",
        [bm.name],
    )


def _base_model_dict(message: Message) -> dict[str, Any]:
    fields = message_dict(message)
    fields.pop("config_json", None)  # verbatim config.json: `show` prints it
    return fields


def cmd_base_model_list(client: RegistryClient, args: argparse.Namespace, out: Output) -> None:
    models = list(client.list_base_models())

    def human(wide: bool) -> str:
        headers = ("NAME", "TYPE", "H", "I", "E", "TOP-K", "MOE-LAYERS", "FINGERPRINT")
        rows = [
            [
                m.name,
                m.model_type,
                str(m.hidden_size),
                str(m.moe_intermediate_size),
                str(m.num_experts),
                str(m.top_k),
                str(len(m.moe_layers)),
                m.fingerprint if wide or not out.terminal else m.fingerprint[:19],
            ]
            for m in models
        ]
        return render_table(headers, rows)

    out.emit([_base_model_dict(m) for m in models], human, [m.name for m in models])


def cmd_base_model_show(client: RegistryClient, args: argparse.Namespace, out: Output) -> None:
    fields = message_dict(client.get_base_model(args.name))

    def human(wide: bool) -> str:
        shown = {k: v for k, v in fields.items() if k != "config_json"}
        return f"{fields_text(shown, 34)}\nconfig_json:\n{fields.get('config_json', '')}"

    out.emit(fields, human, [fields["name"]])


def _local_digest(folder: Path) -> str:
    """The version digest the registry will give the folder's files."""
    hashes = {}
    for name in ADAPTER_FILES:
        with (folder / name).open("rb") as handle:
            hashes[name] = hashlib.file_digest(handle, "sha256").hexdigest()
    return files_digest(hashes)


def cmd_upload(client: RegistryClient, args: argparse.Namespace, out: Output) -> None:
    folder = _folder(args.path)
    total = sum(f.size_bytes for f in describe_folder(folder))
    if not args.allow_duplicate:
        digest = _local_digest(folder)
        same = [v for v in client.list_versions(name=args.name) if v.digest == digest]
        if same:
            version = same[-1]
            out.note(
                f"{_ref(version)} already holds these bytes ({digest}): nothing uploaded "
                "(--allow-duplicate uploads them as a new version)"
            )
            if args.alias:
                client.set_alias(version.name, args.alias, version.version)
                version = client.get(_ref(version))
                out.note(f"{version.name}@{args.alias} -> {version.version}")
            _show_uploaded(out, version, created=False)
            return
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
    _show_uploaded(out, version, created=True)


def _show_uploaded(out: Output, version: registry_pb2.AdapterVersion, created: bool) -> None:
    verb = "uploaded" if created else "already uploaded as"
    out.emit(
        message_dict(version),
        lambda wide: f"{verb} {_ref(version)} {version.digest}",
        [_ref(version)],
    )


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
    out.emit(
        [message_dict(v) for v in versions],
        lambda wide: _versions_table(versions, wide, full_digest=not out.terminal),
        [_ref(v) for v in versions],
    )


def cmd_get(client: RegistryClient, args: argparse.Namespace, out: Output) -> None:
    _show_version(out, client.get(args.ref))


def cmd_download(client: RegistryClient, args: argparse.Namespace, out: Output) -> None:
    target = Path(args.dir)
    version = client.get(args.ref)
    with out.progress(f"download {_ref(version)}", version.size_bytes) as advance:
        pinned = f"{version.name}@{version.digest}"  # the version just shown, whatever moves
        if args.presigned:
            version = client.download_presigned(pinned, target, progress=advance)
        else:
            version = client.download(pinned, target, progress=advance)
    out.emit(
        {"version": message_dict(version), "directory": str(target)},
        lambda wide: f"downloaded {_ref(version)} to {target} (sha256 verified)",
        [str(target)],
    )


def cmd_alias_set(client: RegistryClient, args: argparse.Namespace, out: Output) -> None:
    response = client.set_alias(args.name, args.alias, args.version)
    before = f" (was {response.previous_version})" if response.previous_version else ""
    out.emit(
        {"version": message_dict(response.version), "previous_version": response.previous_version},
        lambda wide: f"{args.name}@{args.alias} -> {args.version}{before}",
        [f"{args.name}@{args.alias}"],
    )


def cmd_alias_rm(client: RegistryClient, args: argparse.Namespace, out: Output) -> None:
    previous = client.delete_alias(args.name, args.alias)
    out.emit(
        {"previous_version": previous},
        lambda wide: f"removed {args.name}@{args.alias} (pointed at {previous})",
        [f"{args.name}@{args.alias}"],
    )


def cmd_delete(client: RegistryClient, args: argparse.Namespace, out: Output) -> None:
    if not AdapterRef.parse(args.ref, "REF").is_pinned_version:
        raise InvalidArgument(
            f"REF {args.ref!r} names no one version: delete NAME:VERSION or NAME@sha256:HEX"
        )
    target = client.get(args.ref)
    aliases = [f"{target.name}@{alias}" for alias in target.aliases]
    try:
        # The registry checks for aliases in the delete's own transaction.
        version = client.delete(f"{target.name}@{target.digest}", refuse_if_aliased=not args.force)
    except FailedPrecondition:
        now = [f"{target.name}@{alias}" for alias in client.get(args.ref).aliases]
        raise FailedPrecondition(
            f"{_ref(target)} is what {', '.join(now)} point{'s' if len(now) == 1 else ''} at: "
            f"deleting it would fail every request for {'it' if len(now) == 1 else 'them'}. "
            f"Point the alias elsewhere first (adapterctl alias set {target.name} ALIAS "
            "VERSION), or pass --force to delete the version and the aliases with it"
        ) from None
    removed = f"; removed {', '.join(aliases)}" if aliases else ""
    out.emit(
        message_dict(version) | {"removed_aliases": aliases},
        lambda wide: (
            f"deleted {_ref(version)}{removed}; still downloadable as "
            f"{version.name}@{version.digest} until gc"
        ),
        [_ref(version)],
    )


def cmd_gc(client: RegistryClient, args: argparse.Namespace, out: Output) -> None:
    report = client.gc(args.grace_seconds or 0, args.dry_run)

    def human(wide: bool) -> str:
        verb = "would remove" if args.dry_run else "removed"
        lines = [
            f"{verb} {len(report.removed_blobs)} blobs ({size_text(report.removed_bytes)}), "
            f"purged {report.purged_versions} versions"
        ]
        return "\n".join(lines + [f"  {key}" for key in report.removed_blobs])

    out.emit(message_dict(report) | {"dry_run": args.dry_run}, human, list(report.removed_blobs))


def cmd_watch(client: RegistryClient, args: argparse.Namespace, out: Output) -> None:
    with client.watch(
        name=args.name or "", base_model=args.base_model or "", after_sequence=args.after
    ) as stream:
        out.note(f"watching events after sequence {stream.start_sequence}")
        for event in stream:
            # One JSON object a line whatever -o says: a stream has no table to align.
            out.line(json.dumps(message_dict(event), sort_keys=True))
            out.stdout.flush()


# -- parsing -----------------------------------------------------------------------------------

EXAMPLES = """examples:
  adapterctl base-model register ./Qwen3-30B-A3B --name qwen3-30b
  adapterctl upload ./sql-expert --name sql-expert --base-model qwen3-30b --alias prod
  adapterctl list                               # every version, a table
  adapterctl list -o name | xargs -n1 adapterctl get -o json
  adapterctl get sql-expert@prod -o yaml
  adapterctl alias set sql-expert prod 2        # move the alias live traffic follows
  adapterctl delete sql-expert:1                # refused while an alias names it
  source <(adapterctl completion bash)

exit codes: 0 ok, 1 other, 2 usage, 3 not found, 4 invalid argument, 5 precondition or
conflict, 6 auth, 7 registry unreachable, 8 too large, 9 data loss, 141 stdout closed"""


def _common(parser: argparse.ArgumentParser, *, top: bool) -> None:
    """Global options, accepted before and after the command."""
    env = os.environ

    def default(value: Any) -> Any:
        return value if top else argparse.SUPPRESS

    parser.add_argument(
        "--address",
        default=default(env.get("MOELORA_REGISTRY_ADDRESS", DEFAULT_ADDRESS)),
        metavar="HOST:PORT",
        help=f"the registry [env: MOELORA_REGISTRY_ADDRESS; default {DEFAULT_ADDRESS}]",
    )
    parser.add_argument(
        "--token",
        default=default(env.get("MOELORA_REGISTRY_TOKEN")),
        help="bearer token (moelora-registry hash-token makes one) [env: MOELORA_REGISTRY_TOKEN]",
    )
    parser.add_argument(
        "--tls",
        action="store_true",
        default=default(env.get("MOELORA_REGISTRY_TLS", "") in ("1", "true", "yes")),
        help="use TLS with the system roots [env: MOELORA_REGISTRY_TLS=1]",
    )
    parser.add_argument(
        "--ca-file",
        default=default(env.get("MOELORA_REGISTRY_CA_FILE")),
        metavar="PEM",
        help="roots to trust; implies --tls [env: MOELORA_REGISTRY_CA_FILE]",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=default(30.0),
        metavar="SECONDS",
        help="deadline of each call, transfers excepted (default 30)",
    )
    parser.add_argument(
        "-o",
        "--output",
        choices=FORMATS,
        default=default("table"),
        help="table (default), wide (more columns), name (one reference a line), json or "
        "yaml (every field; errors as JSON on stderr)",
    )
    parser.add_argument(
        "--json",
        action="store_const",
        const="json",
        dest="output",
        default=argparse.SUPPRESS,
        help="the same as -o json",
    )


class UsageError(Exception):
    """A command line argparse refused: raised instead of argparse's print-and-exit, so that
    ``main`` can answer in the output format the command line asked for."""

    def __init__(self, parser: argparse.ArgumentParser, message: str) -> None:
        super().__init__(message)
        self.parser = parser


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(self, message)


def _requested_format(argv: Sequence[str]) -> str:
    """The output format ``argv`` asks for, read before parsing (which may fail)."""
    requested = "table"
    for i, arg in enumerate(argv):
        if arg == "--json":
            requested = "json"
        elif arg in ("-o", "--output") and i + 1 < len(argv):
            requested = argv[i + 1]
        elif arg.startswith("--output="):
            requested = arg.removeprefix("--output=")
        elif arg.startswith("-o") and len(arg) > 2:
            requested = arg[2:]
    return requested


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Manage adapters in a moe-lora-serve registry.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {package_version()}")
    _common(parser, top=True)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(
        sub: Any, name: str, handler: Callable[..., None], help_text: str, **kwargs: Any
    ) -> Any:
        p = sub.add_parser(name, help=help_text, description=help_text, **kwargs)
        _common(p, top=False)
        p.set_defaults(handler=handler)
        return p

    def group(name: str, help_text: str) -> Any:
        p = commands.add_parser(name, help=help_text, description=help_text)
        return p.add_subparsers(dest=f"{name}_command", required=True, metavar="COMMAND")

    labels = {"action": "append", "default": [], "metavar": "KEY=VALUE"}

    base = group("base-model", "register and inspect base models")
    p = add(
        base,
        "register",
        cmd_base_model_register,
        "register a checkpoint folder (config.json + *.safetensors) as a base model",
    )
    p.add_argument("path", help="the checkpoint folder").complete = shtab.DIRECTORY
    p.add_argument("--name", help="the base model's registry name; default: the folder's name")
    add(base, "list", cmd_base_model_list, "list base models")
    p = add(base, "show", cmd_base_model_show, "show one base model with its config.json")
    p.add_argument("name", help="the base model's registry name")

    p = add(commands, "upload", cmd_upload, "upload an adapter folder as a new version")
    p.add_argument(
        "path", help="folder with adapter_config.json and adapter_model.safetensors"
    ).complete = shtab.DIRECTORY
    p.add_argument("--name", required=True, help="the adapter's name (new or existing)")
    p.add_argument(
        "--base-model", required=True, help="registry name of the base model it was trained on"
    )
    p.add_argument("--alias", help="point NAME@ALIAS at the new version")
    p.add_argument("--description", help="free text kept with the version")
    p.add_argument("--label", help="a label to filter by (repeatable)", **labels)
    p.add_argument(
        "--allow-duplicate",
        action="store_true",
        help="upload even when a version of NAME already holds these exact bytes (by "
        "default nothing is created then, and --alias moves to that version)",
    )

    p = add(commands, "list", cmd_list, "list adapter versions (every value whole in a pipe)")
    p.add_argument("--name", help="only versions of this adapter")
    p.add_argument("--base-model", help="only adapters of this base model")
    p.add_argument("--label", help="only versions with this label (repeatable: all)", **labels)
    p.add_argument(
        "--include-deleted", action="store_true", help="soft-deleted versions too (until gc)"
    )
    p.add_argument("--latest", action="store_true", help="only the newest version of each name")

    ref_help = "name (newest), name:VERSION, name@ALIAS or name@sha256:HEX"
    for name in ("get", "show"):
        p = add(commands, name, cmd_get, f"show one version ({ref_help})")
        p.add_argument("ref", help=ref_help)

    p = add(commands, "download", cmd_download, "download a version's files, sha256-verified")
    p.add_argument("ref", help=ref_help)
    p.add_argument(
        "dir", metavar="DIR", help="folder to write the files into"
    ).complete = shtab.DIRECTORY
    p.add_argument(
        "--presigned",
        action="store_true",
        help="fetch straight from the blob store over presigned URLs",
    )

    alias = group("alias", "move or remove NAME@ALIAS")
    p = add(alias, "set", cmd_alias_set, "point NAME@ALIAS at VERSION")
    p.add_argument("name", help="the adapter's name")
    p.add_argument("alias", help="the alias, e.g. prod")
    p.add_argument("version", type=int, help="the version number it points at from now on")
    p = add(alias, "rm", cmd_alias_rm, "remove NAME@ALIAS")
    p.add_argument("name", help="the adapter's name")
    p.add_argument("alias", help="the alias to remove")

    p = add(
        commands,
        "delete",
        cmd_delete,
        "soft-delete a version (refused while an alias points at it, unless --force)",
    )
    p.add_argument("ref", help=ref_help)
    p.add_argument(
        "--force",
        action="store_true",
        help="delete even when aliases point at the version; they are removed with it",
    )

    p = add(commands, "gc", cmd_gc, "remove unreferenced blobs and purge deleted versions")
    p.add_argument(
        "--grace-seconds",
        type=int,
        metavar="N",
        help="spare what is younger than this; default: the server's gc_grace_seconds",
    )
    p.add_argument("--dry-run", action="store_true", help="say what would go, remove nothing")

    p = add(commands, "watch", cmd_watch, "print change events as JSON lines until interrupted")
    p.add_argument("--name", help="only events of this adapter")
    p.add_argument("--base-model", help="only events of adapters of this base model")
    p.add_argument(
        "--after",
        type=int,
        default=0,
        metavar="SEQUENCE",
        help="replay the events after this sequence first (default: only new ones)",
    )

    p = commands.add_parser(
        "completion",
        help="print a shell completion script",
        description="Print a completion script: source <(adapterctl completion bash), or "
        "write it into your shell's completion folder.",
    )
    p.add_argument("shell", choices=("bash", "zsh", "tcsh"), help="the shell")
    p.set_defaults(handler=None)
    return parser


def _fix(exc: MoeLoraError, address: str) -> str:
    """The error's message, with what to do when the registry could not be reached."""
    if exc.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return (
            f"{exc.message} (no registry answered at {address}: start it, or point "
            "--address / MOELORA_REGISTRY_ADDRESS at it)"
        )
    if exc.code is grpc.StatusCode.UNAUTHENTICATED:
        return f"{exc.message} (pass --token or set MOELORA_REGISTRY_TOKEN)"
    return exc.message


def main(argv: Sequence[str] | None = None) -> None:
    parser = build_parser()
    words = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parser.parse_args(words)
    except UsageError as exc:
        usage = Output(_requested_format(words))
        if usage.structured:
            usage.error(PROG, "USAGE", str(exc), 2)
        else:
            exc.parser.print_usage(sys.stderr)
            print(f"{exc.parser.prog}: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    out = Output(args.output)
    try:
        if args.handler is None:
            out.line(shtab.complete(parser, args.shell))
            return
        root_certificates = Path(args.ca_file).read_bytes() if args.ca_file else None
        with RegistryClient(
            args.address,
            token=args.token,
            tls=args.tls,
            root_certificates=root_certificates,
            timeout=args.timeout,
        ) as client:
            args.handler(client, args, out)
        sys.stdout.flush()
    except MoeLoraError as exc:
        code = EXIT_CODES.get(exc.code, 1)
        out.error(PROG, exc.code.name, _fix(exc, args.address), code)
        raise SystemExit(code) from None
    except BrokenPipeError:
        # The reader went away (| head): no traceback, and no second error at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(EXIT_BROKEN_PIPE) from None
    except OSError as exc:
        out.error(PROG, "OS_ERROR", str(exc), 1)
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
