"""adapterctl against a real registry subprocess: register, upload, list, show,
download (byte-identical), on SQLite and PostgreSQL, local and S3 blobs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shared.tokens import Role, new_token_entry
from tests.registry.conftest import BASE, BlobSetting, adapterctl, launch_registry
from tests.registry.fixtures import write_adapter, write_base_model


def _ok(result: Any) -> Any:
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout) if result.stdout.strip().startswith(("{", "[")) else None


def test_upload_list_show_download_round_trip(
    start_server: Any,
    tmp_path: Path,
    database_url: str,
    blob_setting: BlobSetting,
    base_model_dir: Path,
) -> None:
    registry = launch_registry(
        start_server,
        tmp_path / "data",
        "--database-url",
        database_url,
        "--auth",
        "off",
        *blob_setting.flags(),
    )
    address = registry.address
    adapter = write_adapter(tmp_path / "adapter", rank=4)

    registered = _ok(adapterctl(address, "--json", "base-model", "register", str(base_model_dir)))
    assert registered["created"] is True and registered["base_model"]["name"] == BASE

    uploaded = _ok(
        adapterctl(
            address,
            "upload",
            str(adapter),
            "--name",
            "sql-expert",
            "--base-model",
            BASE,
            "--alias",
            "prod",
            "--label",
            "team=data",
            "--description",
            "text to SQL",
            "--json",
        )
    )
    assert uploaded["version"] == 1 and uploaded["status"] == "READY"
    assert uploaded["rank"] == 4 and uploaded["format"] == "PEFT_3D"

    listed = _ok(adapterctl(address, "list", "--json", "--label", "team=data"))
    assert [(v["name"], v["version"]) for v in listed] == [("sql-expert", 1)]

    shown = _ok(adapterctl(address, "show", "sql-expert@prod", "--json"))
    assert shown["digest"] == uploaded["digest"] and shown["aliases"] == ["prod"]

    out = tmp_path / "downloaded"
    _ok(adapterctl(address, "download", "sql-expert@prod", str(out)))
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (out / name).read_bytes() == (adapter / name).read_bytes()
    # From the bucket (S3) or the registry's blob HTTP server (local store).
    direct = tmp_path / "presigned"
    _ok(adapterctl(address, "download", "sql-expert:1", str(direct), "--presigned"))
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (direct / name).read_bytes() == (adapter / name).read_bytes()

    # Human output and errors: one readable line, a meaningful exit code.
    table = adapterctl(address, "list")
    assert table.returncode == 0 and "sql-expert" in table.stdout
    details = adapterctl(address, "show", "sql-expert:1")
    weights = next(f for f in shown["files"] if f["path"] == "adapter_model.safetensors")
    pieces = len(weights["part_sha256"])
    assert pieces >= 1 and f"{pieces} pieces of 16.0MiB sha256-checked" in details.stdout
    missing = adapterctl(address, "show", "sql-expert:7")
    assert missing.returncode == 3
    assert missing.stderr.strip().splitlines() == [
        "adapterctl: NOT_FOUND: adapter 'sql-expert' has no READY version 7"
    ]


def test_alias_delete_gc_watch_and_exit_codes(
    start_server: Any, tmp_path: Path, base_model_dir: Path
) -> None:
    admin, admin_entry = new_token_entry("ops", Role.ADMIN)
    reader, reader_entry = new_token_entry("viewer", Role.READ)
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps({"tokens": [admin_entry, reader_entry]}))
    registry = launch_registry(
        start_server, tmp_path / "data", "--auth", "on", "--auth-tokens-file", str(tokens)
    )
    address = registry.address

    def ctl(*args: str, token: str | None = admin) -> Any:
        return adapterctl(address, *args, token=token)

    _ok(ctl("base-model", "register", str(base_model_dir)))
    for seed in (1, 2):
        adapter = write_adapter(tmp_path / f"a{seed}", seed=seed)
        _ok(ctl("upload", str(adapter), "--name", "sql", "--base-model", BASE))
    assert ctl("alias", "set", "sql", "prod", "1").stdout.strip() == "sql@prod -> 1"
    assert ctl("alias", "set", "sql", "prod", "2").stdout.strip() == "sql@prod -> 2 (was 1)"
    assert _ok(ctl("--json", "alias", "rm", "sql", "prod")) == {"previous_version": 2}
    deleted = _ok(ctl("delete", "sql:2", "--json"))
    assert deleted["status"] == "DELETED"
    dry = _ok(ctl("gc", "--grace-seconds", "3600", "--dry-run", "--json"))
    assert dry["dry_run"] is True and dry["purged_versions"] == 0  # deleted just now
    assert ctl("watch", "--after", "999").returncode == 4  # OUT_OF_RANGE

    other_checkpoint = write_base_model(tmp_path / "other", seed=7)
    adapter = tmp_path / "a1"
    codes = {
        "usage": ctl("upload").returncode,
        "not found": ctl("show", "sql:9").returncode,
        "invalid": ctl("delete", "sql").returncode,  # a bare name pins no version
        "precondition": ctl(
            "upload", str(adapter), "--name", "n", "--base-model", "nope"
        ).returncode,
        "conflict": ctl("base-model", "register", str(other_checkpoint), "--name", BASE).returncode,
        "unauthenticated": ctl("list", token=None).returncode,
        "denied": ctl("delete", "sql:1", token=reader).returncode,
    }
    assert codes == {
        "usage": 2,
        "not found": 3,
        "invalid": 4,
        "precondition": 5,
        "conflict": 5,
        "unauthenticated": 6,
        "denied": 6,
    }
    denied = ctl("delete", "sql:1", token=reader)
    assert denied.stderr.startswith("adapterctl: PERMISSION_DENIED: token 'viewer' has role read")
