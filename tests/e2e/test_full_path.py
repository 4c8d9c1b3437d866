"""The whole path with real processes on 127.0.0.1: a registry (SQLite + local blobs), adapters
uploaded with the adapterctl CLI, an executor that pulls them from the registry, and Forward
calls checked against transformers + PEFT. Then the registry's changes reach the executor
without a restart (alias moves, deletions), and a registry outage leaves cached adapters
serving while unknown ones fail UNAVAILABLE; the executor reconnects by itself."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from moelora.client.errors import NotFound, Unavailable
from moelora.client.executor import ExecutorClient, ForwardResult, RetryPolicy
from moelora.client.health import wait_until_serving
from moelora.v1 import executor_pb2
from shared.ports import free_port
from tests.conftest import ServerProcess, wait_for
from tests.executor.conftest import assert_close
from tests.executor.worlds import Recipe, World, build_world

BASE = "tiny-qwen3"
RECIPES = [
    Recipe("sql_v1", "both", seed=1),
    Recipe("sql_v2", "rslora", seed=2),
    Recipe("chat", "down_only", seed=3),
]
BIN = Path(sys.executable).parent


@dataclass
class Cluster:
    world: World
    registry_address: str
    registry: ServerProcess
    registry_args: list[str]
    executor: ExecutorClient
    executor_log: Path
    tmp: Path


def adapterctl(address: str, *args: str) -> dict[str, Any]:
    """Runs the CLI with ``--json``; returns its parsed output (asserting exit 0)."""
    done = subprocess.run(
        [str(BIN / "adapterctl"), "--address", address, "--json", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"adapterctl {' '.join(args)}: {done.stderr}"
    return json.loads(done.stdout) if done.stdout.strip() else {}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("e2e")
    world = build_world("qwen3_moe", tmp / "world", RECIPES)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    registry_address = f"127.0.0.1:{free_port()}"
    registry_args = [
        str(BIN / "moelora-registry"),
        "--listen", registry_address,
        "--data-dir", str(tmp / "registry"),
        "--metrics-listen", "",
        "--drain-seconds", "1",
    ]  # fmt: skip
    registry = ServerProcess(registry_args, env, tmp / "registry.log")
    with grpc.insecure_channel(registry_address) as channel:
        wait_until_serving(channel, "moelora.v1.AdapterRegistry", timeout=60)

    adapterctl(registry_address, "base-model", "register", str(world.checkpoint), "--name", BASE)
    upload = ["upload", "--base-model", BASE]
    adapterctl(registry_address, *upload, str(world.adapter_dir / "sql_v1"), "--name", "sql",
               "--alias", "prod")  # fmt: skip
    adapterctl(registry_address, *upload, str(world.adapter_dir / "sql_v2"), "--name", "sql")
    adapterctl(registry_address, *upload, str(world.adapter_dir / "chat"), "--name", "chat")

    executor_address = f"127.0.0.1:{free_port()}"
    executor_log = tmp / "executor.log"
    executor = ServerProcess(
        [
            str(BIN / "moelora-executor"),
            "--listen", executor_address,
            "--base-model-path", str(world.checkpoint),
            "--base-model-name", BASE,
            "--registry-address", registry_address,
            "--registry-timeout-seconds", "3",
            "--disk-cache-dir", str(tmp / "executor-cache"),
            "--num-slots", "4",
            "--max-rank", "8",
            "--device", "cpu",  # float32 parity (GPU parity through Forward: tests/executor)
            "--metrics-listen", "",
            "--drain-seconds", "2",
        ],
        env,
        executor_log,
    )  # fmt: skip
    with grpc.insecure_channel(executor_address) as channel:
        wait_until_serving(channel, "moelora.v1.Executor", timeout=120)
    client = ExecutorClient(executor_address, timeout=30, retry=RetryPolicy(attempts=1))
    cluster = Cluster(world, registry_address, registry, registry_args, client, executor_log, tmp)
    try:
        yield cluster
    finally:
        client.close()
        code = executor.terminate()
        # A test may have replaced the registry (killed and restarted it): stop both.
        registry.terminate()
        cluster.registry.terminate()
        assert code == 0, executor.log()


def forward(
    cluster: Cluster, segments: list[tuple[int, str | None]]
) -> ForwardResult[torch.Tensor]:
    layer = cluster.world.moe_layers[0]
    hidden = cluster.world.inputs[layer][: sum(n for n, _ in segments)]
    return cluster.executor.forward(layer, hidden, segments)


def expected(cluster: Cluster, segments: list[tuple[int, str | None]]) -> torch.Tensor:
    return cluster.world.expected(cluster.world.moe_layers[0], segments)


def test_mixed_batch_matches_transformers_and_peft(cluster: Cluster) -> None:
    result = forward(cluster, [(3, "sql@prod"), (2, None), (4, "chat"), (3, "sql:2")])
    assert result.resolved_adapters == ["sql:1", "", "chat:1", "sql:2"]
    assert_close(
        result.output, expected(cluster, [(3, "sql_v1"), (2, None), (4, "chat"), (3, "sql_v2")])
    )


def test_alias_move_reaches_the_executor_without_restart(cluster: Cluster) -> None:
    adapterctl(cluster.registry_address, "alias", "set", "sql", "canary", "1")
    assert forward(cluster, [(2, "sql@canary")]).resolved_adapters == ["sql:1"]
    adapterctl(cluster.registry_address, "alias", "set", "sql", "canary", "2")

    def moved() -> bool:
        return forward(cluster, [(2, "sql@canary")]).resolved_adapters == ["sql:2"]

    wait_for(moved, timeout=15)
    result = forward(cluster, [(5, "sql@canary")])
    assert_close(result.output, expected(cluster, [(5, "sql_v2")]))


def test_deleted_version_is_refused_and_dropped(cluster: Cluster) -> None:
    loaded = forward(cluster, [(2, "chat:1")])
    assert loaded.resolved_adapters == ["chat:1"]
    adapterctl(cluster.registry_address, "delete", "chat:1")

    def refused() -> bool:
        try:
            forward(cluster, [(2, "chat:1")])
        except NotFound:
            return True
        return False

    wait_for(refused, timeout=15)
    held = {(a.name, a.version) for a in cluster.executor.list_loaded_adapters().adapters}
    assert ("chat", 1) not in held  # neither in a slot, the host cache nor the disk cache


def test_unloaded_adapters_stay_listed_from_the_disk_cache(cluster: Cluster) -> None:
    forward(cluster, [(2, "sql:2")])
    cluster.executor.unload_adapter("sql:2")
    where = {(a.name, a.version): a for a in cluster.executor.list_loaded_adapters().adapters}
    assert where[("sql", 2)].location == executor_pb2.ADAPTER_LOCATION_DISK
    assert where[("sql", 2)].slot == -1


def test_registry_outage_keeps_cached_adapters_serving(cluster: Cluster) -> None:
    # Resolved and packed before the outage; "fresh" is uploaded but never used.
    forward(cluster, [(2, "sql@prod"), (1, "sql:2")])
    world = cluster.world
    adapterctl(cluster.registry_address, "upload", str(world.adapter_dir / "sql_v2"),
               "--name", "fresh", "--base-model", BASE)  # fmt: skip
    cluster.registry.proc.send_signal(signal.SIGKILL)
    cluster.registry.proc.wait(30)

    result = forward(cluster, [(3, "sql@prod"), (2, None), (2, "sql:2")])
    assert_close(result.output, expected(cluster, [(3, "sql_v1"), (2, None), (2, "sql_v2")]))
    with pytest.raises(Unavailable, match="cannot be reached"):
        forward(cluster, [(2, "fresh")])

    # Back on the same port and data: the executor reconnects by itself.
    cluster.registry = ServerProcess(
        cluster.registry_args, {**os.environ}, cluster.tmp / "registry-restarted.log"
    )
    with grpc.insecure_channel(cluster.registry_address) as channel:
        wait_until_serving(channel, "moelora.v1.AdapterRegistry", timeout=60)
    wait_for(lambda: _watch_connections(cluster) == 2, timeout=30)
    result = forward(cluster, [(4, "fresh")])
    assert_close(result.output, expected(cluster, [(4, "sql_v2")]))


def _watch_connections(cluster: Cluster) -> int:
    """How often the executor's registry watch (re)connected, from its JSON log."""
    lines = cluster.executor_log.read_text().splitlines()
    events = [json.loads(line) for line in lines if line.startswith("{")]
    return sum(1 for e in events if e.get("event") == "registry_watch_connected")
