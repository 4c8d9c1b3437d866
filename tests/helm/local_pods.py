"""Runs a pod's rendered configuration on this machine: the same commands and
environment, with only what a pod cannot have here moved (listen ports to free
loopback ports, volume mounts to folders under tmp)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path
from typing import Any

import boto3
import pytest

from shared.ports import free_port
from tests.conftest import REPO, wait_for

PROBE = REPO / "docker" / "grpc_health_probe.py"
BIN = Path(sys.executable).parent
AWS = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"}


# Where the chart mounts volumes; here they become folders under tmp.
MOUNTS = ("/data", "/etc/moelora/auth", "/models", "/var/cache/moelora")


def relocate(env: dict[str, str], tmp: Path) -> dict[str, str]:
    """The pod's environment, runnable here: free loopback ports, volumes under tmp."""
    moved = {}
    for name, value in env.items():
        if name.startswith("MOELORA_") and name.endswith("_LISTEN") and value:
            value = f"127.0.0.1:{free_port()}"
        moved[name] = relocate_path(value, tmp)
    if moved.get(
        "MOELORA_REGISTRY_HTTP_PUBLIC_URL"
    ):  # the Service's name resolves in the cluster only
        moved["MOELORA_REGISTRY_HTTP_PUBLIC_URL"] = (
            f"http://{moved['MOELORA_REGISTRY_HTTP_LISTEN']}"
        )
    return moved


def relocate_path(value: str, tmp: Path) -> str:
    scheme = "file://" if value.startswith("file://") else ""
    path = value.removeprefix(scheme)
    if any(path == m or path.startswith(m + "/") for m in MOUNTS):
        return f"{scheme}{tmp}{path}"
    return value


def clean_env(env: dict[str, str]) -> dict[str, str]:
    """This process's environment without MOELORA_* and AWS_*, plus ``env``."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("MOELORA_", "AWS_"))}
    return {**base, "PYTHONUNBUFFERED": "1", **env}


def probe_serving(address: str, service: str) -> bool:
    result = subprocess.run(
        [sys.executable, str(PROBE), f"--service={service}", address],
        capture_output=True,
        text=True,
        timeout=30,
    )
    return result.returncode == 0


def start_serving(
    start_server: Any, command: list[str], service: str, env: dict[str, str], timeout: float = 60
) -> Any:
    """Runs a console script and its arguments with ``env`` until `helm test`'s probe
    sees it SERVING; checks its metrics endpoint when it has one."""
    script, *args = command
    server = start_server(script, *args, env=env)
    prefix = next(p for p in ("MOELORA_REGISTRY_", "MOELORA_EXECUTOR_") if f"{p}LISTEN" in env)
    address = env[f"{prefix}LISTEN"]
    try:
        wait_for(
            lambda: server.proc.poll() is not None or probe_serving(address, service),
            timeout=timeout,
        )
    except TimeoutError:
        pytest.fail(f"{script} not SERVING:\n{server.log()}")
    assert server.proc.poll() is None, server.log()
    if env[f"{prefix}METRICS_LISTEN"]:
        metrics_url = f"http://{env[f'{prefix}METRICS_LISTEN']}/metrics"
        metrics = urllib.request.urlopen(metrics_url).read()
        # The probe's health checks went through the server's RPC metrics.
        health_ok = (
            b'grpc_code="OK",grpc_method="Check",grpc_service="grpc.health.v1.Health",'
            b'grpc_type="unary"'
        )
        assert b"grpc_server_handled_total{" + health_ok in metrics
    return server


def notes_forward_snippet(notes: str) -> str:
    """The Python program NOTES.txt tells the operator to run against an executor."""
    lines = notes.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "python - <<'EOF'")
    end = next(i for i in range(start + 1, len(lines)) if lines[i].strip() == "EOF")
    return textwrap.dedent("\n".join(lines[start + 1 : end]))


def s3_client(endpoint: str) -> Any:
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id=AWS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=AWS["AWS_SECRET_ACCESS_KEY"],
    )
