"""Both servers start from their console scripts with embedded defaults, answer
health and reflection on 127.0.0.1, and exit cleanly on SIGTERM."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2

from moelora.client.health import health_check, wait_until_serving
from shared.ports import free_port

REGISTRY = "moelora.v1.AdapterRegistry"
EXECUTOR = "moelora.v1.Executor"


#: Reflection's two protocol versions: the same messages under two service names.
REFLECTION = ("grpc.reflection.v1alpha.ServerReflection", "grpc.reflection.v1.ServerReflection")


def _reflect(
    channel: grpc.Channel, request: reflection_pb2.ServerReflectionRequest, service: str
) -> reflection_pb2.ServerReflectionResponse:
    call = channel.stream_stream(
        f"/{service}/ServerReflectionInfo",
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )
    return next(iter(call(iter([request]), timeout=10)))


def _list_services(channel: grpc.Channel, service: str = REFLECTION[0]) -> set[str]:
    answer = _reflect(channel, reflection_pb2.ServerReflectionRequest(list_services=""), service)
    return {s.name for s in answer.list_services_response.service}


def _file_containing(channel: grpc.Channel, symbol: str, service: str = REFLECTION[0]) -> bool:
    request = reflection_pb2.ServerReflectionRequest(file_containing_symbol=symbol)
    answer = _reflect(channel, request, service)
    return bool(answer.file_descriptor_response.file_descriptor_proto)


def _json_events(log: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in log.splitlines() if line.startswith("{")]


def test_registry_starts_serves_health_reflection_and_drains(
    start_server: Any, tmp_path: Path
) -> None:
    port = free_port()
    server = start_server(
        "moelora-registry",
        "--listen",
        f"127.0.0.1:{port}",
        "--data-dir",
        str(tmp_path / "registry"),
        "--metrics-listen",
        f"127.0.0.1:{free_port()}",
        "--drain-seconds",
        "2",
    )
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        wait_until_serving(channel, REGISTRY, timeout=60)
        assert health_check(channel) == "SERVING"
        services = _list_services(channel)
        assert {REGISTRY, "grpc.health.v1.Health"} <= services
        assert _file_containing(channel, REGISTRY)
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(30) == 0
    events = [e.get("event") for e in _json_events(server.log())]
    assert events.index("server_draining") < events.index("server_stopped")


@pytest.mark.parametrize("reflection", REFLECTION)
def test_reflection_answers_in_both_protocol_versions(
    start_server: Any, tmp_path: Path, reflection: str
) -> None:
    port = free_port()
    start_server(
        "moelora-registry", "--listen", f"127.0.0.1:{port}", "--data-dir", str(tmp_path / "r"),
        "--metrics-listen", "",
    )  # fmt: skip
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        wait_until_serving(channel, REGISTRY, timeout=60)
        assert {REGISTRY, "grpc.health.v1.Health", *REFLECTION} <= _list_services(
            channel, reflection
        )
        for symbol in (REGISTRY, *REFLECTION):
            assert _file_containing(channel, symbol, reflection), symbol


def test_invalid_flag_exits_2_with_one_readable_line(start_server: Any) -> None:
    server = start_server("moelora-executor", "--num-slots", "0")
    assert server.proc.wait(60) == 2
    assert "--num-slots / MOELORA_EXECUTOR_NUM_SLOTS" in server.log()


@pytest.mark.parametrize("script", ["moelora-registry", "moelora-executor"])
def test_env_twin_is_read(start_server: Any, script: str) -> None:
    prefix = "MOELORA_REGISTRY_" if script == "moelora-registry" else "MOELORA_EXECUTOR_"
    server = start_server(script, env={f"{prefix}LOG_FORMAT": "yaml"})
    assert server.proc.wait(60) == 2
    assert f"{prefix}LOG_FORMAT" in server.log()


@pytest.mark.parametrize("script", ["moelora-registry", "moelora-executor"])
def test_old_env_names_still_work_with_a_deprecation_warning(
    start_server: Any, script: str
) -> None:
    new = "MOELORA_REGISTRY_" if script == "moelora-registry" else "MOELORA_EXECUTOR_"
    server = start_server(script, env={"MOELORA_LOG_FORMAT": "yaml"})
    assert server.proc.wait(60) == 2  # the old name was read: its value is refused
    log = server.log()
    assert f"MOELORA_LOG_FORMAT is deprecated (rename it {new}LOG_FORMAT)" in log


BUF = Path(__file__).resolve().parents[2] / ".tools/node_modules/.bin/buf"


@pytest.mark.skipif(not BUF.exists(), reason="buf not installed: run `make setup`")
def test_outside_client_uses_only_reflection(start_server: Any, tmp_path: Path) -> None:
    """`buf curl` has none of our protos: it learns the API by reflection alone."""
    import subprocess

    port = free_port()
    start_server(
        "moelora-registry",
        "--listen",
        f"127.0.0.1:{port}",
        "--data-dir",
        str(tmp_path / "r"),
        "--metrics-listen",
        "",
    )
    url = f"http://127.0.0.1:{port}"
    base = [str(BUF), "curl", "--protocol", "grpc", "--http2-prior-knowledge"]
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        wait_until_serving(channel, REGISTRY, timeout=60)
    for protocol in ("grpc-v1", "grpc-v1alpha"):
        listed = subprocess.run(
            [*base, "--reflect-protocol", protocol, "--list-methods", url],
            capture_output=True,
            text=True,
            check=True,
        )
        assert f"{REGISTRY}/UploadAdapter" in listed.stdout.split()
    health = subprocess.run(
        [*base, "-d", json.dumps({"service": REGISTRY}), f"{url}/grpc.health.v1.Health/Check"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(health.stdout) == {"status": "SERVING"}
