"""Executor processes on 127.0.0.x for the cluster tests: real ``moelora-executor`` console
scripts, each possibly serving a layer range, stopped at teardown."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import pytest
import torch

from executor_service.synthetic import (
    SyntheticAdapter,
    SyntheticBase,
    write_adapter,
    write_base_checkpoint,
)
from moelora.client.executor import ExecutorClient
from shared.ports import free_port

#: The routing world: a synthetic qwen3_moe base and this many adapters.
NUM_ADAPTERS = 12


@dataclass(frozen=True)
class Replica:
    """One executor process and its address."""

    address: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL: the replica vanishes without draining (a node lost)."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)


StartReplicas = Callable[..., list[Replica]]


@dataclass(frozen=True)
class RoutingWorld:
    checkpoint: Path
    adapter_dir: Path
    adapters: list[str]
    moe_layers: tuple[int, ...]
    hidden_size: int


@pytest.fixture(scope="session")
def routing_world(tmp_path_factory: pytest.TempPathFactory) -> RoutingWorld:
    root = tmp_path_factory.mktemp("routing_world")
    base = SyntheticBase("qwen3_moe", hidden_size=32, moe_intermediate_size=16, num_experts=4)
    spec = write_base_checkpoint(root / "base", base, dtype=torch.float32)
    names = [f"a{i:02d}" for i in range(NUM_ADAPTERS)]
    for seed, name in enumerate(names):
        write_adapter(root / "adapters" / name, spec, SyntheticAdapter(rank=4), seed=seed)
    return RoutingWorld(root / "base", root / "adapters", names, spec.moe_layers, 32)


@pytest.fixture
def start_replicas(tmp_path: Path) -> Iterator[StartReplicas]:
    """``start_replicas(checkpoint, adapter_dir, specs)`` with ``specs`` a list of
    (host, layers or None): one executor process each, all started at once, returned once all
    serve. ``port`` shares one port among hosts (for DNS-style endpoints); ``module`` runs
    ``python -m module`` instead of the console script (an executor with an injected kernel)."""
    started: list[tuple[Replica, IO[bytes]]] = []

    def start(
        checkpoint: Path,
        adapter_dir: Path,
        specs: list[tuple[str, str | None]],
        num_slots: int = 4,
        port: int | None = None,
        module: str | None = None,
        device: str = "cpu",
    ) -> list[Replica]:
        replicas = []
        exe = [str(Path(sys.executable).parent / "moelora-executor")]
        if module is not None:
            exe = [sys.executable, "-m", module]
        for host, layers in specs:
            address = f"{host}:{port or free_port()}"
            args = [
                *exe,
                "--listen", address,
                "--base-model-path", str(checkpoint),
                "--adapter-dir", str(adapter_dir),
                "--device", device,
                "--kernel-autotune-seconds", "0",
                "--num-slots", str(num_slots),
                "--max-rank", "8",
                "--metrics-listen", "",
                "--drain-seconds", "2",
                "--replica-name", f"replica-{len(started)}",
            ]  # fmt: skip
            if layers is not None:
                args += ["--layers", layers]
            log_path = tmp_path / f"executor-{len(started)}.log"
            log_file = log_path.open("wb")
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            proc = subprocess.Popen(args, env=env, stdout=log_file, stderr=subprocess.STDOUT)
            replica = Replica(address, proc, log_path)
            started.append((replica, log_file))
            replicas.append(replica)
        for replica in replicas:
            with ExecutorClient(replica.address) as client:
                try:
                    client.wait_until_serving(timeout=120)
                except TimeoutError:
                    raise AssertionError(replica.log()) from None
        return replicas

    yield start
    for replica, log_file in started:
        if replica.proc.poll() is None:
            replica.proc.terminate()
        try:
            replica.proc.wait(30)
        except subprocess.TimeoutExpired:
            replica.proc.kill()
            replica.proc.wait()
        log_file.close()
