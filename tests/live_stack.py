"""A registry and an executor as real processes on 127.0.0.1 over a world of tiny transformers
checkpoints and PEFT adapters (``tests.executor.worlds``): what the fuzz, chaos and soak suites
run against. Both can be killed and restarted on the same data; their RSS and open file
descriptors are read from /proc."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from moelora.client.executor import ExecutorClient, RetryPolicy
from moelora.client.health import wait_until_serving
from moelora.client.model_spec import read_model_spec
from moelora.client.registry import RegistryClient
from shared.ports import free_port
from tests.conftest import ServerProcess
from tests.executor.worlds import World

BIN = Path(sys.executable).parent
BASE = "tiny-qwen"


def _descriptors(pid: int) -> list[Path]:
    try:
        return list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:  # the process exited meanwhile
        return []


def service_pids(pid: int) -> list[int]:
    """``pid`` and its descendants: a service is its whole process tree (an executor's gRPC
    front ends are child processes of its engine, and it is they that receive the bytes)."""
    pids, index = [pid], 0
    while index < len(pids):
        for task in Path(f"/proc/{pids[index]}/task").glob("*/children"):
            with contextlib.suppress(OSError):
                pids.extend(int(child) for child in task.read_text().split())
        index += 1
    return pids


def rss_bytes(pid: int) -> int:
    """Resident bytes of the service whose main process is ``pid``, children included."""
    total = 0
    for member in service_pids(pid):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{member}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
    if not total:
        raise ValueError(f"no VmRSS for pid {pid}")
    return total


def open_fds(pid: int) -> int:
    """Open descriptors of the service, children included."""
    total = 0
    for member in service_pids(pid):
        with contextlib.suppress(OSError):
            total += sum(1 for _ in Path(f"/proc/{member}/fd").iterdir())
    return total


def open_files(pid: int) -> int:
    """Open descriptors that are not sockets or SQLite's files (files, pipes, eventfds): what a
    leak grows.
    Sockets come and go with clients' connections (a kept-alive connection is not a leak), and
    so do the files of a download in progress (the disk cache's ``.partial-`` folders, while
    they exist: a descriptor left on one after it is gone reads "(deleted)" and counts)."""
    return len(file_targets(pid))


def file_targets(pid: int) -> list[str]:
    """What ``open_files`` counts: each such descriptor's target, children included."""
    targets = []
    for fd in [fd for member in service_pids(pid) for fd in _descriptors(member)]:
        try:
            target = str(fd.readlink())
        except OSError:  # closed meanwhile
            continue
        in_flight = "/.partial-" in target and not target.endswith("(deleted)")
        # SQLite's files, once per pooled connection: the pool's size bounds them, and a
        # short run may open its last connections late.
        database = target.endswith((".db", ".db-wal", ".db-shm"))
        if not (target.startswith("socket:") or in_flight or database):
            targets.append(target)
    return targets


@dataclass
class Stack:
    """``start()`` brings both up; ``stop()`` (always, in a finally) takes both down."""

    world: World
    tmp: Path
    executor_flags: tuple[str, ...] = ()
    registry_flags: tuple[str, ...] = ()
    #: The token the stack's own clients send (auth on: one with the admin role).
    token: str | None = None
    registry_address: str = field(default_factory=lambda: f"127.0.0.1:{free_port()}")
    executor_address: str = field(default_factory=lambda: f"127.0.0.1:{free_port()}")
    registry: ServerProcess | None = None
    executor: ServerProcess | None = None
    _logs: int = 0

    @property
    def data_dir(self) -> Path:
        return self.tmp / "registry"

    @property
    def cache_dir(self) -> Path:
        return self.tmp / "executor-cache"

    def _log(self, name: str) -> Path:
        self._logs += 1
        return self.tmp / f"{name}-{self._logs}.log"

    def start_registry(self) -> ServerProcess:
        args = [
            str(BIN / "moelora-registry"),
            "--listen", self.registry_address,
            "--data-dir", str(self.data_dir),
            "--metrics-listen", "",
            "--drain-seconds", "1",
            *self.registry_flags,
        ]  # fmt: skip
        self.registry = ServerProcess(args, _env(), self._log("registry"))
        with grpc.insecure_channel(self.registry_address) as channel:
            wait_until_serving(channel, "moelora.v1.AdapterRegistry", timeout=60)
        return self.registry

    def start_executor(self) -> ServerProcess:
        args = [
            str(BIN / "moelora-executor"),
            "--listen", self.executor_address,
            "--base-model-path", str(self.world.checkpoint),
            "--base-model-name", BASE,
            "--registry-address", self.registry_address,
            "--registry-timeout-seconds", "5",
            "--disk-cache-dir", str(self.cache_dir),
            "--metrics-listen", "",
            "--drain-seconds", "2",
            "--device", "cpu",
            *self.executor_flags,
        ]  # fmt: skip
        self.executor = ServerProcess(args, _env(), self._log("executor"))
        with grpc.insecure_channel(self.executor_address) as channel:
            wait_until_serving(channel, "moelora.v1.Executor", timeout=120)
        return self.executor

    def start(self, adapters: list[str] | None = None, *, executor: bool = True) -> None:
        """Both servers (the registry alone without ``executor``), the base model registered
        and ``adapters`` (folder names of the world) uploaded under their own names."""
        self.start_registry()
        with self.registry_client() as client:
            spec = read_model_spec(self.world.checkpoint)
            client.register_base_model(spec.to_proto(BASE))
            for name in adapters or ():
                client.upload(self.world.adapter_dir / name, name, BASE)
        if executor:
            self.start_executor()

    def kill(self, process: ServerProcess | None) -> None:
        """SIGKILL: no drain, no clean-up; the process is reaped and its log closed."""
        if process is not None:
            if process.proc.poll() is None:
                process.proc.send_signal(signal.SIGKILL)
            process.terminate()

    def stop(self) -> None:
        for process in (self.executor, self.registry):
            if process is not None:
                process.terminate()

    def registry_client(self) -> RegistryClient:
        return RegistryClient(self.registry_address, timeout=30, token=self.token)

    def executor_client(self, attempts: int = 1, timeout: float = 30.0) -> ExecutorClient:
        return ExecutorClient(
            self.executor_address,
            timeout=timeout,
            retry=RetryPolicy(attempts=attempts),
            token=self.token,
        )


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1"}
