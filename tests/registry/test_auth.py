"""Bearer tokens and roles: missing or unknown tokens are UNAUTHENTICATED, a role
below the RPC's is PERMISSION_DENIED, and the token's name is recorded."""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from moelora.client.auth import bearer_metadata, bearer_token
from moelora.client.errors import MoeLoraError
from shared.ports import free_port
from shared.tokens import Role
from tests.conftest import wait_for
from tests.registry.conftest import BASE, Served, register_base
from tests.registry.fixtures import write_adapter


def _code(call: Callable[[], Any]) -> grpc.StatusCode:
    with pytest.raises(MoeLoraError) as info:
        call()
    return info.value.code


def test_roles_are_checked_per_rpc(
    serve: Callable[..., Served],
    tokens: tuple[Path, dict[str, str]],
    tmp_path: Path,
    base_model_dir: Path,
) -> None:
    path, secret = tokens
    served = serve(auth="on", auth_tokens_file=path)
    adapter = write_adapter(tmp_path / "a")
    anonymous, wrong = served.client(), served.client(token="not-a-token")
    reader, writer, admin = (served.client(token=secret[r]) for r in ("read", "write", "admin"))

    assert _code(lambda: list(anonymous.list_versions())) == grpc.StatusCode.UNAUTHENTICATED
    assert _code(lambda: wrong.get("x")) == grpc.StatusCode.UNAUTHENTICATED
    assert _code(lambda: register_base(writer, base_model_dir)) == grpc.StatusCode.PERMISSION_DENIED
    register_base(admin, base_model_dir)

    assert _code(lambda: reader.upload(adapter, "a", BASE)) == grpc.StatusCode.PERMISSION_DENIED
    version = writer.upload(adapter, "a", BASE)
    assert version.created_by == "write"
    assert reader.get("a").digest == version.digest
    assert _code(lambda: reader.set_alias("a", "prod", 1)) == grpc.StatusCode.PERMISSION_DENIED
    assert _code(lambda: reader.delete("a:1")) == grpc.StatusCode.PERMISSION_DENIED
    assert _code(anonymous.watch) == grpc.StatusCode.UNAUTHENTICATED
    assert _code(lambda: writer.gc(dry_run=True)) == grpc.StatusCode.PERMISSION_DENIED
    assert admin.gc(dry_run=True).removed_blobs == []
    with pytest.raises(MoeLoraError) as info:
        reader.delete("a:1")
    assert "token 'read' has role read; this call needs write" in info.value.message
    for client in (anonymous, wrong, reader, writer, admin):
        client.close()


def test_revoked_token_stops_working_without_restart(
    serve: Callable[..., Served], tokens: tuple[Path, dict[str, str]]
) -> None:
    path, secret = tokens
    served = serve(auth="on", auth_tokens_file=path)
    with served.client(token=secret["read"]) as reader:
        assert list(reader.list_versions()) == []
        entries = json.loads(path.read_text())["tokens"]
        path.write_text(json.dumps({"tokens": [e for e in entries if e["name"] != "read"]}))

        def refused() -> bool:
            try:
                list(reader.list_versions())
            except MoeLoraError as exc:
                return bool(exc.code == grpc.StatusCode.UNAUTHENTICATED)
            return False

        wait_for(refused, timeout=10, interval=0.2)


def test_auth_needs_a_tokens_file_outside_embedded_mode(start_server: Any, tmp_path: Path) -> None:
    # auto: a non-loopback address or external storage turns auth on.
    server = start_server(
        "moelora-registry",
        "--listen",
        f"0.0.0.0:{free_port()}",
        "--data-dir",
        str(tmp_path / "data"),
        "--metrics-listen",
        "",
    )
    assert server.proc.wait(60) == 1
    assert "auth=auto outside the embedded mode needs --auth-tokens-file" in server.log()


def test_hash_token_prints_a_usable_entry(start_server: Any) -> None:
    process = start_server("moelora-registry", "hash-token", "ci-bot", "write")
    assert process.proc.wait(60) == 0
    made = json.loads(process.log().strip().splitlines()[-1])
    assert made["entry"]["name"] == "ci-bot" and made["entry"]["role"] == "write"
    assert made["entry"]["sha256"] == hashlib.sha256(made["token"].encode()).hexdigest()


def test_bearer_header_reading_and_writing() -> None:
    assert bearer_metadata("abc") == (("authorization", "Bearer abc"),)
    for bad in ("", " abc", "a b", "tok\n"):
        with pytest.raises(ValueError):
            bearer_metadata(bad)
    assert bearer_token([("authorization", "Bearer abc")]) == "abc"
    assert bearer_token([("x-other", "1"), ("Authorization", b"bearer  abc ")]) == "abc"
    assert bearer_token([("authorization", "Basic YWJj")]) is None
    assert bearer_token([("authorization", "Bearer ")]) is None
    assert bearer_token(None) is None


#: Every registry RPC that changes state, and the least role it needs.
_STATE_CHANGING: dict[str, tuple[Role, Callable[[Any, dict[str, Path]], Any]]] = {
    "RegisterBaseModel": (Role.ADMIN, lambda c, d: register_base(c, d["base"], "other-base")),
    "UploadAdapter": (Role.WRITE, lambda c, d: c.upload(d["adapter"], "b", BASE)),
    "SetAlias": (Role.WRITE, lambda c, d: c.set_alias("a", "canary", 1)),
    "DeleteAlias": (Role.WRITE, lambda c, d: c.delete_alias("a", "prod")),
    "DeleteAdapterVersion": (Role.WRITE, lambda c, d: c.delete("a:1")),
    "GarbageCollect": (Role.ADMIN, lambda c, d: c.gc(grace_seconds=0)),
}


@pytest.mark.parametrize("rpc", sorted(_STATE_CHANGING))
def test_state_changing_rpc_refuses_the_anonymous_and_the_underprivileged(
    rpc: str,
    serve: Callable[..., Served],
    tokens: tuple[Path, dict[str, str]],
    tmp_path: Path,
    base_model_dir: Path,
) -> None:
    path, secret = tokens
    served = serve(auth="on", auth_tokens_file=path)
    role, call = _STATE_CHANGING[rpc]
    files = {"base": base_model_dir, "adapter": write_adapter(tmp_path / "adapter")}
    with served.client(token=secret["admin"]) as admin:
        register_base(admin, base_model_dir)
        admin.upload(files["adapter"], "a", BASE, alias="prod")
        before = _registry_state(admin)
        callers = [(served.client(), grpc.StatusCode.UNAUTHENTICATED)]
        callers.append((served.client(token="forged-token"), grpc.StatusCode.UNAUTHENTICATED))
        callers += [
            (served.client(token=secret[r.name.lower()]), grpc.StatusCode.PERMISSION_DENIED)
            for r in Role
            if r < role
        ]
        for client, code in callers:
            with client:
                assert _code(functools.partial(call, client, files)) == code
        assert _registry_state(admin) == before  # nothing changed
        call(admin, files)  # the role it needs is enough


def _registry_state(client: Any) -> tuple[object, ...]:
    versions = sorted(
        (v.name, v.version, v.digest, tuple(sorted(v.aliases)), v.status)
        for v in client.list_versions(include_deleted=True)
    )
    bases = sorted(b.name for b in client.list_base_models())
    return tuple(versions), tuple(bases)
