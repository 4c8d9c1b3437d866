"""What each service exports on /metrics, read over HTTP from the running processes: names
that pass promtool's lint, the gRPC conventions' labels, no ``_created`` series, the build,
the registry's inventory, and nothing but 404 off /metrics."""

from __future__ import annotations

import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from shared.version import package_version
from tests.observability.conftest import ADAPTERS, WIDE, Stack
from tests.observability.prometheus import Prometheus, promtool

JOBS = ("registry", "executor")


def _scrape(stack: Stack, job: str, path: str = "/metrics") -> bytes:
    with urllib.request.urlopen(f"http://{stack.metrics[job]}{path}", timeout=10) as answer:
        return bytes(answer.read())


def _samples(stack: Stack, job: str) -> dict[str, list[dict[str, str]]]:
    """Sample name -> the label sets it was exported with."""
    found: dict[str, list[dict[str, str]]] = {}
    for family in text_string_to_metric_families(_scrape(stack, job).decode()):
        for sample in family.samples:
            found.setdefault(sample.name, []).append(dict(sample.labels))
    return found


@pytest.mark.parametrize("job", JOBS)
def test_names_pass_promtool_check_metrics(stack: Stack, prometheus: Prometheus, job: str) -> None:
    assert promtool("check", "metrics", stdin=_scrape(stack, job)).strip() == ""


@pytest.mark.parametrize("job", JOBS)
def test_grpc_metrics_carry_the_conventions_labels(
    stack: Stack, prometheus: Prometheus, job: str
) -> None:
    samples = _samples(stack, job)
    service = {"registry": "moelora.v1.AdapterRegistry", "executor": "moelora.v1.Executor"}[job]
    labels = {"grpc_type", "grpc_service", "grpc_method"}
    for name in ("grpc_server_started_total", "grpc_server_msg_received_total"):
        assert all(set(s) == labels for s in samples[name]), name
    handled = samples["grpc_server_handled_total"]
    assert all(set(s) == {*labels, "grpc_code"} for s in handled)
    assert {"grpc_type": "unary", "grpc_service": "grpc.health.v1.Health", "grpc_method": "Check",
            "grpc_code": "OK"} in handled  # fmt: skip
    mine = {(s["grpc_method"], s["grpc_type"], s["grpc_code"]) for s in handled}
    mine &= {(s["grpc_method"], s["grpc_type"], s["grpc_code"]) for s in handled
             if s["grpc_service"] == service}  # fmt: skip
    expected = {
        "registry": {
            ("UploadAdapter", "client_stream", "OK"),
            ("GetAdapter", "unary", "NOT_FOUND"),
            ("DownloadAdapter", "server_stream", "OK"),
        },
        "executor": {
            ("Forward", "unary", "OK"),
            ("Forward", "unary", "NOT_FOUND"),
            ("Forward", "unary", "FAILED_PRECONDITION"),
            ("ForwardStream", "bidi_stream", "OK"),
        },
    }[job]
    assert expected <= mine
    # Streams that answer many times have lifetimes of their own, not latencies.
    latency = {s["grpc_type"] for s in samples["grpc_server_handling_seconds_count"]}
    lifetimes = {s["grpc_type"] for s in samples["moelora_grpc_server_stream_seconds_count"]}
    assert latency <= {"unary", "client_stream"} and "unary" in latency
    assert lifetimes and lifetimes <= {"server_stream", "bidi_stream"}
    assert {"grpc_service": service} in samples["moelora_grpc_server_serving"]


@pytest.mark.parametrize("job", JOBS)
def test_no_created_series_and_the_build_is_named(
    stack: Stack, prometheus: Prometheus, job: str
) -> None:
    samples = _samples(stack, job)
    assert [name for name in samples if name.endswith("_created")] == []
    [build] = samples["moelora_build_info"]
    assert build["version"] == package_version() and build["commit"] not in ("", "unknown")
    assert "process_resident_memory_bytes" in samples


@pytest.mark.parametrize("job", JOBS)
@pytest.mark.parametrize("path", ["/", "/healthz", "/metrics/", "/favicon.ico"])
def test_only_metrics_is_served(stack: Stack, job: str, path: str) -> None:
    with pytest.raises(urllib.error.HTTPError) as refused:
        _scrape(stack, job, path)
    assert refused.value.code == 404


def test_registry_inventory(stack: Stack, prometheus: Prometheus) -> None:
    samples = _samples(stack, "registry")
    text = _scrape(stack, "registry").decode()
    statuses = {s["status"] for s in samples["moelora_registry_versions"]}
    assert statuses == {"PENDING", "READY", "FAILED", "DELETED"}
    assert f'moelora_registry_versions{{status="READY"}} {len(ADAPTERS) + 1}.0' in text
    assert f"moelora_registry_adapters {len([*ADAPTERS, WIDE])}.0" in text
    assert "moelora_registry_base_models 1.0" in text
    ready_bytes = [
        line for line in text.splitlines()
        if line.startswith('moelora_registry_version_bytes{status="READY"}')
    ]  # fmt: skip
    assert len(ready_bytes) == 1 and float(ready_bytes[0].split()[1]) > 0
    assert "moelora_registry_database_errors_total 0.0" in text


def test_the_front_ends_memory_is_exported_apart(stack: Stack, prometheus: Prometheus) -> None:
    """process_resident_memory_bytes is the engine's; each front end's is its own series."""
    resident = [
        line
        for line in _scrape(stack, "executor").decode().splitlines()
        if line.startswith("moelora_executor_frontend_resident_memory_bytes{")
    ]
    labels = [line.split("{")[1].split("}")[0] for line in resident]
    assert labels and labels == [f'front_end="{i}"' for i in range(len(labels))]
    assert all(float(line.split()[1]) > 10 * 2**20 for line in resident)  # Python with grpc
