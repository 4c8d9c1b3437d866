"""Requests that used to break the server (INTERNAL) get the status that names the caller's
mistake: forged page tokens, an upload description with NUL (PostgreSQL's text cannot hold it),
and bytes that are not protobuf on every RPC of both services (with a token: INVALID_ARGUMENT;
without: UNAUTHENTICATED, decided before the bytes are read)."""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from moelora.client.auth import bearer_metadata
from moelora.client.errors import InvalidArgument
from moelora.v1 import executor_pb2, registry_pb2, registry_pb2_grpc
from tests.executor.worlds import World
from tests.hostile.conftest import Tokens
from tests.live_stack import BASE, Stack


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def registry(
    request: pytest.FixtureRequest, hostile_world: World, tmp_path: Path
) -> Iterator[Stack]:
    """A registry process on SQLite or PostgreSQL with one adapter in three versions."""
    flags: tuple[str, ...] = ()
    if request.param == "postgres":
        url = request.getfixturevalue("pg_schema_url")
        flags = ("--database-url", url, "--auth", "off")
    stack = Stack(hostile_world, tmp_path, registry_flags=flags)
    try:
        stack.start(["alpha"], executor=False)
        with stack.registry_client() as client:
            for _ in range(2):
                client.upload(hostile_world.adapter_dir / "alpha", "alpha", BASE)
        yield stack
    finally:
        stack.stop()


def _unkeyed(key: object, filters: object) -> str:
    """A token as the registry used to make them: anyone could."""
    text = json.dumps(filters, sort_keys=True, separators=(",", ":"))
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    payload = json.dumps({"k": key, "f": digest}, separators=(",", ":"), ensure_ascii=False)
    raw = payload.encode("utf-8", "surrogatepass")
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def test_forged_and_edited_page_tokens_are_invalid_argument(registry: Stack) -> None:
    filters = ["", "", [], False, False]
    deep = "[" * 100_000 + "]" * 100_000
    forged = [
        _unkeyed(["alpha", 2**63], filters),
        _unkeyed(["alpha", True], filters),
        _unkeyed(["\ud800", 1], filters),
        _unkeyed(["al\0pha", 1], filters),
        base64.urlsafe_b64encode(('{"k":' + deep + ',"f":"x"}').encode()).decode(),
        "!!!",
        "A" * 100_000,
    ]
    codes = []
    with (
        registry.registry_client() as client,
        grpc.insecure_channel(
            registry.registry_address, options=[("grpc.max_send_message_length", -1)]
        ) as channel,
    ):
        stub = registry_pb2_grpc.AdapterRegistryStub(channel)
        first = stub.ListAdapters(registry_pb2.ListAdaptersRequest(page_size=1))
        assert first.next_page_token
        edited = first.next_page_token[:-2] + ("AA" if first.next_page_token[-2:] != "AA" else "BB")
        for token in [*forged, edited]:
            for call in (stub.ListAdapters, stub.ListBaseModels):
                request = (
                    registry_pb2.ListAdaptersRequest(page_size=1, page_token=token)
                    if call is stub.ListAdapters
                    else registry_pb2.ListBaseModelsRequest(page_size=1, page_token=token)
                )
                try:
                    call(request, timeout=30)
                    codes.append("OK")
                except grpc.RpcError as exc:
                    assert isinstance(exc, grpc.Call)
                    codes.append(exc.code().name)
        # The real token still works.
        second = stub.ListAdapters(
            registry_pb2.ListAdaptersRequest(page_size=1, page_token=first.next_page_token)
        )
        assert second.versions and second.versions[0].version != first.versions[0].version
        assert len(list(client.list_versions(name="alpha"))) == 3
    assert codes == ["INVALID_ARGUMENT"] * len(codes)


def test_a_description_with_nul_is_invalid_argument(registry: Stack, tmp_path: Path) -> None:
    adapter = tmp_path / "nul"
    shutil.copytree(registry.world.adapter_dir / "alpha", adapter)
    with registry.registry_client() as client:
        with pytest.raises(InvalidArgument, match=r"header\.description: must not contain NUL"):
            client.upload(adapter, "alpha", BASE, description="before\0after")
        assert len(list(client.list_versions(name="alpha"))) == 3


def _methods(service: object) -> list[tuple[str, bool, bool]]:
    """(full name, client streaming, server streaming) of every RPC of ``service``."""
    return [
        (f"/{service.full_name}/{m.name}", m.client_streaming, m.server_streaming)  # type: ignore[attr-defined]
        for m in service.methods  # type: ignore[attr-defined]
    ]


def _call_raw(
    channel: grpc.Channel, method: str, client_streaming: bool, server_streaming: bool,
    body: bytes, metadata: tuple[tuple[str, str], ...] | None,
) -> str:  # fmt: skip
    try:
        if client_streaming and server_streaming:
            list(channel.stream_stream(method)(iter([body]), metadata=metadata, timeout=10))
        elif client_streaming:
            channel.stream_unary(method)(iter([body]), metadata=metadata, timeout=10)
        elif server_streaming:
            list(channel.unary_stream(method)(body, metadata=metadata, timeout=10))
        else:
            channel.unary_unary(method)(body, metadata=metadata, timeout=10)
        return "OK"
    except grpc.RpcError as exc:
        assert isinstance(exc, grpc.Call)
        return str(exc.code().name)


#: Not protobuf: field 1 as a length-delimited value running past the end.
GARBAGE = b"\x0a\xff\xff\xff\x0f" + b"\x00" * 8


def test_bytes_that_are_not_protobuf_are_invalid_argument_on_every_rpc(
    authed_stack: Stack, hostile_tokens: Tokens
) -> None:
    services = {
        authed_stack.executor_address: executor_pb2.DESCRIPTOR.services_by_name["Executor"],
        authed_stack.registry_address: registry_pb2.DESCRIPTOR.services_by_name["AdapterRegistry"],
    }
    admin = bearer_metadata(hostile_tokens.plain["admin"])
    with_token, without = {}, {}
    for address, service in services.items():
        with grpc.insecure_channel(address) as channel:
            for method, client_streaming, server_streaming in _methods(service):
                args = (channel, method, client_streaming, server_streaming, GARBAGE)
                with_token[method] = _call_raw(*args, admin)
                without[method] = _call_raw(*args, None)
    print(f"\nnot protobuf, with a token: {set(with_token.values())}; "
          f"without: {set(without.values())} ({len(with_token)} RPCs)")  # fmt: skip
    assert set(with_token.values()) == {"INVALID_ARGUMENT"}, with_token
    assert set(without.values()) == {"UNAUTHENTICATED"}, without
