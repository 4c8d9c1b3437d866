"""adapterctl as a script and a shell pipeline meet it, against a real registry subprocess:
whole values in a pipe, every output format, errors as JSON, a closed pipe, the delete guard,
identical re-uploads, --version, completion, help on every flag; moelora-registry's help."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from registry_service.cli.main import build_parser
from tests.registry.conftest import BASE, adapterctl, launch_registry
from tests.registry.fixtures import write_adapter

BIN = Path(sys.executable).parent
LONG_NAME = "chat-tone-formal-and-very-long-adapter-name"


@pytest.fixture
def registry(start_server: Any, tmp_path: Path, base_model_dir: Path) -> str:
    address = launch_registry(start_server, tmp_path / "data", "--auth", "off").address
    assert adapterctl(address, "base-model", "register", str(base_model_dir)).returncode == 0
    for name, seed in (("sql-expert", 1), ("sql-expert", 2), (LONG_NAME, 3)):
        folder = write_adapter(tmp_path / f"{name}-{seed}", seed=seed)
        done = adapterctl(address, "upload", str(folder), "--name", name, "--base-model", BASE)
        assert done.returncode == 0, done.stderr
    assert adapterctl(address, "alias", "set", "sql-expert", "prod", "1").returncode == 0
    return address


def _json(done: subprocess.CompletedProcess[str]) -> Any:
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_pipe_gets_every_value_whole_and_every_format_parses(registry: str) -> None:
    listed = _json(adapterctl(registry, "list", "-o", "json"))
    table = adapterctl(registry, "list")  # stdout is a pipe here
    rows = [line.split() for line in table.stdout.splitlines()]
    assert rows[0] == [
        "NAME", "VERSION", "STATUS", "BASE-MODEL", "RANK", "SIZE", "ALIASES", "DIGEST"
    ]  # fmt: skip
    # awk '{print $1, $2, $8}' works: one word per column, empty ones shown as "-".
    assert {(r[0], r[1], r[6], r[7]) for r in rows[1:]} == {
        (v["name"], str(v["version"]), ",".join(v["aliases"]) or "-", v["digest"]) for v in listed
    }
    assert all(len(r) == 8 and r[2] == "READY" for r in rows[1:])
    wide = adapterctl(registry, "list", "-o", "wide").stdout.splitlines()
    assert wide[0].split()[-5:] == ["FORMAT", "LAYERS", "LABELS", "CREATED", "CREATED-BY"]
    names = adapterctl(registry, "list", "-o", "name").stdout.split()
    assert sorted(names) == sorted(f"{v['name']}:{v['version']}" for v in listed)

    shown = _json(adapterctl(registry, "-o", "json", "get", "sql-expert@prod"))
    as_yaml = yaml.safe_load(adapterctl(registry, "get", "sql-expert@prod", "-o", "yaml").stdout)
    assert shown == as_yaml
    # Every field, numbers as numbers, the table's words, zero values too.
    assert shown["status"] == "READY" and shown["format"] == "PEFT_3D"
    assert isinstance(shown["size_bytes"], int) and shown["size_bytes"] > 0
    assert isinstance(shown["files"][0]["size_bytes"], int)
    assert shown["description"] == "" and shown["labels"] == {} and shown["delete_time"] is None
    assert shown["aliases"] == ["prod"] and shown["version"] == 1
    dry = _json(adapterctl(registry, "gc", "--dry-run", "--json"))
    assert dry == {"dry_run": True, "purged_versions": 0, "removed_blobs": [], "removed_bytes": 0}


def test_errors_name_the_fix_and_come_as_json_with_json_output(
    registry: str, tmp_path: Path
) -> None:
    missing = adapterctl(registry, "-o", "json", "get", "sql-expert:9")
    assert missing.returncode == 3 and missing.stdout == ""
    assert json.loads(missing.stderr) == {
        "error": {
            "code": "NOT_FOUND",
            "exit_code": 3,
            "message": "adapter 'sql-expert' has no READY version 9",
        }
    }
    nowhere = adapterctl("127.0.0.1:1", "list")
    assert nowhere.returncode == 7
    assert "--address / MOELORA_REGISTRY_ADDRESS" in nowhere.stderr
    folder = tmp_path / "nope"
    absent = adapterctl(registry, "upload", str(folder), "--name", "x", "--base-model", BASE)
    assert absent.returncode == 4
    assert absent.stderr.strip() == (
        f"adapterctl: INVALID_ARGUMENT: {folder} does not exist: give the folder that holds "
        "the files"
    )


def test_a_command_line_argparse_refuses_is_json_too_with_json_output() -> None:
    """A usage error needs no registry: JSON on stderr with -o json (wherever it stands),
    argparse's usage and one line otherwise; exit 2 either way."""
    for words in (["-o", "json", "get"], ["list", "--json", "--bogus"], ["--output=json", "get"]):
        done = subprocess.run([str(BIN / "adapterctl"), *words], capture_output=True, text=True)
        assert done.returncode == 2 and done.stdout == "", words
        error = json.loads(done.stderr)["error"]
        assert error["code"] == "USAGE" and error["exit_code"] == 2, words
    plain = subprocess.run([str(BIN / "adapterctl"), "get"], capture_output=True, text=True)
    assert plain.returncode == 2 and plain.stderr.startswith("usage: adapterctl get")
    assert "adapterctl get: error: the following arguments are required: ref" in plain.stderr


def test_a_closed_pipe_ends_quietly(registry: str) -> None:
    command = [str(BIN / "adapterctl"), "--address", registry, "list", "-o", "json"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert process.stdout is not None and process.stderr is not None
    process.stdout.close()  # `| head` that has read enough
    code = process.wait(60)
    stderr = process.stderr.read().decode()
    process.stderr.close()
    assert (code, stderr) == (141, "")


def test_deleting_a_version_an_alias_names_needs_force(registry: str) -> None:
    refused = adapterctl(registry, "delete", "sql-expert:1")
    assert refused.returncode == 5
    assert "sql-expert@prod" in refused.stderr and "--force" in refused.stderr
    assert _json(adapterctl(registry, "get", "sql-expert@prod", "--json"))["version"] == 1
    forced = adapterctl(registry, "delete", "sql-expert:1", "--force")
    assert forced.returncode == 0, forced.stderr
    assert "removed sql-expert@prod" in forced.stdout
    assert adapterctl(registry, "get", "sql-expert@prod").returncode == 3
    # A version no alias names goes without --force.
    assert (
        _json(adapterctl(registry, "delete", "sql-expert:2", "-o", "json"))["removed_aliases"] == []
    )


def test_uploading_identical_bytes_again_creates_nothing_unless_asked(
    registry: str, tmp_path: Path
) -> None:
    folder = write_adapter(tmp_path / "again", seed=2)  # sql-expert:2's bytes
    upload = ("upload", str(folder), "--name", "sql-expert", "--base-model", BASE)
    again = adapterctl(registry, *upload, "--alias", "canary", "-o", "json")
    assert _json(again)["version"] == 2 and "sql-expert:2 already holds these bytes" in again.stderr
    assert _json(adapterctl(registry, "get", "sql-expert@canary", "-o", "json"))["version"] == 2
    assert len(_json(adapterctl(registry, "list", "--name", "sql-expert", "-o", "json"))) == 2
    forced = _json(adapterctl(registry, *upload, "--allow-duplicate", "-o", "json"))
    assert forced["version"] == 3


def test_version_completion_and_help_on_every_flag() -> None:
    version = subprocess.run([str(BIN / "adapterctl"), "--version"], capture_output=True, text=True)
    assert version.returncode == 0 and version.stdout.startswith("adapterctl ")
    script = subprocess.run(
        [str(BIN / "adapterctl"), "completion", "bash"], capture_output=True, text=True
    )
    assert script.returncode == 0 and "complete" in script.stdout and "upload" in script.stdout
    bash = subprocess.run(["bash", "-n"], input=script.stdout, capture_output=True, text=True)
    assert bash.returncode == 0, bash.stderr
    missing = [
        f"{parser.prog} {'/'.join(action.option_strings) or action.dest}"
        for parser in _parsers(build_parser())
        for action in parser._actions
        if not action.help and not isinstance(action, argparse._SubParsersAction)
    ]
    assert missing == []
    assert "examples:" in build_parser().format_help()


def _parsers(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                found += _parsers(child)
    return found


def test_moelora_registry_help_lists_its_commands_each_with_its_own_help() -> None:
    def run(*args: str) -> str:
        done = subprocess.run(
            [str(BIN / "moelora-registry"), *args], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        return done.stdout

    top = run("--help")
    for command in ("serve", "migrate", "gc", "backfill-parts", "hash-token"):
        assert f"\n  {command} " in top
    migrate = run("migrate", "--help")
    assert migrate.startswith("usage: moelora-registry migrate")
    assert "bring the database schema up to date" in migrate
    assert "{Path,null}" not in migrate and "--data-dir Path" in migrate
    assert "--dry-run" in run("gc", "--help")
    assert "created_by" in run("hash-token", "--help")
