"""Executor auth: the registry's token file and roles. Forward and the listings need read,
Load/Unload/Pin/Unpin need admin; a missing or unknown token is UNAUTHENTICATED, a lower role
PERMISSION_DENIED, and a refused call changes nothing."""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest

from executor_service.app import ExecutorApp
from executor_service.auth import METHOD_ROLES
from executor_service.config import ExecutorSettings
from executor_service.metrics import ExecutorMetrics
from moelora.client.errors import MoeLoraError
from moelora.client.executor import ExecutorClient, ForwardCall, RetryPolicy
from moelora.client.health import health_check
from moelora.client.shared_memory import SHM_ROOT
from moelora.v1 import executor_pb2
from shared.tokens import Role
from tests.conftest import wait_for
from tests.executor.conftest import Placement, StartExecutor
from tests.executor.worlds import World
from tests.tls_certs import self_signed

Tokens = tuple[Path, dict[str, str]]

#: Every executor RPC that changes state, and a call of it that would succeed with admin.
_STATE_CHANGING: dict[str, Callable[[ExecutorClient], Any]] = {
    "LoadAdapter": lambda c: c.load_adapter("beta", to_gpu=True),
    "UnloadAdapter": lambda c: c.unload_adapter("alpha"),
    "PinAdapter": lambda c: c.pin_adapter("alpha"),
    "UnpinAdapter": lambda c: c.unpin_adapter("gamma"),
}


def _client(address: str, token: str | None = None) -> ExecutorClient:
    return ExecutorClient(address, timeout=30, retry=RetryPolicy(attempts=1), token=token)


def _code(call: Callable[[], Any]) -> grpc.StatusCode:
    with pytest.raises(MoeLoraError) as info:
        call()
    return info.value.code


def _residency(client: ExecutorClient) -> list[tuple[str, int, int, int, bool]]:
    return sorted(
        (a.name, a.version, a.location, a.slot, a.pinned)
        for a in client.list_loaded_adapters().adapters
    )


def test_every_rpc_has_a_role() -> None:
    service = executor_pb2.DESCRIPTOR.services_by_name["Executor"]
    named = {f"/{service.full_name}/{m.name}" for m in service.methods}
    assert set(METHOD_ROLES) == named
    assert {m.rsplit("/", 1)[1] for m, r in METHOD_ROLES.items() if r is Role.ADMIN} == set(
        _STATE_CHANGING
    )


@pytest.mark.parametrize("rpc", sorted(_STATE_CHANGING))
def test_state_changing_rpc_refuses_the_anonymous_and_the_underprivileged(
    rpc: str, qwen_world: World, start_executor: StartExecutor, tokens: Tokens
) -> None:
    path, secret = tokens
    running = start_executor(qwen_world, auth="on", auth_tokens_file=path)
    address = running.app.address
    with _client(address, secret["admin"]) as admin:
        admin.load_adapter("alpha", to_gpu=True)
        admin.pin_adapter("gamma")
        before = _residency(admin)
        callers = [
            (_client(address), grpc.StatusCode.UNAUTHENTICATED),
            (_client(address, "forged-token"), grpc.StatusCode.UNAUTHENTICATED),
            (_client(address, secret["read"]), grpc.StatusCode.PERMISSION_DENIED),
            (_client(address, secret["write"]), grpc.StatusCode.PERMISSION_DENIED),
        ]
        for client, code in callers:
            with client:
                assert _code(functools.partial(_STATE_CHANGING[rpc], client)) == code
        assert _residency(admin) == before
        _STATE_CHANGING[rpc](admin)
        assert _residency(admin) != before


def test_forward_and_listings_need_read(
    qwen_world: World, start_executor: StartExecutor, tokens: Tokens, placement: Placement
) -> None:
    path, secret = tokens
    running = start_executor(qwen_world, auth="on", auth_tokens_file=path, **placement.settings)
    address = running.app.address
    layer = qwen_world.moe_layers[0]
    hidden = qwen_world.inputs[layer][:4]
    segments: list[tuple[int, str | None]] = [(2, "alpha"), (2, None)]
    with _client(address) as anonymous, _client(address, secret["read"]) as reader:
        assert _code(lambda: anonymous.forward(layer, hidden, segments)).name == "UNAUTHENTICATED"
        assert _code(anonymous.get_executor_info).name == "UNAUTHENTICATED"
        assert _code(anonymous.list_loaded_adapters).name == "UNAUTHENTICATED"
        stream = anonymous.forward_stream([ForwardCall(layer, hidden)])
        assert _code(lambda: list(stream)).name == "UNAUTHENTICATED"
        # Probes need no token.
        with grpc.insecure_channel(address) as channel:
            assert health_check(channel, "moelora.v1.Executor") == "SERVING"

        result = reader.forward(layer, hidden, segments)
        placement.check(result.output, qwen_world.expected(layer, segments))
        assert reader.get_executor_info().num_slots == 4
        assert [a.name for a in reader.list_loaded_adapters().adapters] == ["alpha"]


def test_revoked_token_stops_working_without_restart(
    qwen_world: World, start_executor: StartExecutor, tokens: Tokens
) -> None:
    path, secret = tokens
    running = start_executor(qwen_world, auth="on", auth_tokens_file=path)
    with _client(running.app.address, secret["read"]) as reader:
        reader.get_executor_info()
        entries = json.loads(path.read_text())["tokens"]
        path.write_text(json.dumps({"tokens": [e for e in entries if e["name"] != "read"]}))

        def refused() -> bool:
            try:
                reader.get_executor_info()
            except MoeLoraError as exc:
                return bool(exc.code == grpc.StatusCode.UNAUTHENTICATED)
            return False

        wait_for(refused, timeout=10, interval=0.2)


def test_auth_auto_off_loopback_needs_a_tokens_file(qwen_world: World) -> None:
    values: dict[str, Any] = {
        "listen": "0.0.0.0:0",
        "base_model_path": qwen_world.checkpoint,
        "metrics_listen": "",
    }
    settings = ExecutorSettings(**values)
    arenas = f"moelora-frontend-{os.getpid()}-*"
    before = set(SHM_ROOT.glob(arenas))
    with pytest.raises(ValueError, match="auth=auto off loopback needs --auth-tokens-file"):
        ExecutorApp(settings, ExecutorMetrics())
    assert set(SHM_ROOT.glob(arenas)) == before, "a refused executor left its arena behind"


def test_tls_with_a_token(
    qwen_world: World, start_executor: StartExecutor, tokens: Tokens, tmp_path: Path
) -> None:
    cert, key = self_signed(tmp_path)
    path, secret = tokens
    running = start_executor(
        qwen_world, auth="on", auth_tokens_file=path, tls_cert_file=cert, tls_key_file=key
    )
    address = running.app.address
    trusted = ExecutorClient(
        address, timeout=10, root_certificates=cert.read_bytes(), token=secret["admin"]
    )
    with trusted:
        assert trusted.pin_adapter("alpha").pinned
    with _client(address, secret["admin"]) as plain:  # no TLS: the handshake fails
        assert _code(plain.get_executor_info).name == "UNAVAILABLE"
