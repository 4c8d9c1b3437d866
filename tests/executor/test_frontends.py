"""The executor as its processes: the engine (the GPU's owner) and ``--frontends`` gRPC front
ends on one port. Requests spread over the front ends get the engine's answers; a front end
that dies is started again while the others serve; front ends whose engine died exit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch

from executor_service.serving.frontends import ENGINE_GONE_EXIT_CODE
from moelora.client.errors import MoeLoraError, Unavailable
from moelora.client.executor import ExecutorClient, RetryPolicy
from moelora.client.health import health_check
from moelora.client.shared_memory import SHM_ROOT, Segment
from moelora.v1 import executor_pb2 as ex
from moelora.v1 import executor_pb2_grpc
from shared.ports import free_port
from tests.conftest import wait_for
from tests.executor.conftest import assert_close
from tests.executor.test_shared_memory import _request as _shared_request
from tests.executor.worlds import TOKENS, World


@dataclass
class Executor:
    proc: subprocess.Popen[bytes]
    address: str
    log_path: Path

    def events(self, name: str) -> list[dict[str, object]]:
        found = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                event = json.loads(line)
                if event.get("event") == name:
                    found.append(event)
        return found

    def front_end_pids(self) -> set[int]:
        gone = {int(e["pid"]) for e in self.events("front_end_gone")}  # type: ignore[call-overload]
        pids = {int(e["pid"]) for e in self.events("front_end_connected")}  # type: ignore[call-overload]
        return pids - gone


@pytest.fixture
def executor(qwen_world: World, tmp_path: Path) -> Iterator[Executor]:
    address = f"127.0.0.1:{free_port()}"
    log_path = tmp_path / "executor.log"
    args = [
        sys.executable, "-m", "executor_service.main", "--listen", address,
        "--base-model-path", str(qwen_world.checkpoint), "--adapter-dir",
        str(qwen_world.adapter_dir), "--device", "cpu", "--num-slots", "4", "--max-rank", "8",
        "--metrics-listen", "", "--drain-seconds", "2", "--frontends", "2",
        "--disk-cache-dir", str(tmp_path / "cache"),
    ]  # fmt: skip
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT)
    running = Executor(proc, address, log_path)
    try:
        with ExecutorClient(address) as client:
            client.wait_until_serving(timeout=120)
        wait_for(lambda: len(running.front_end_pids()) == 2, timeout=60)
        yield running
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for pid in running.front_end_pids():
            _wait_gone(pid)


def _wait_gone(pid: int, timeout: float = 30.0) -> bool:
    """Whether process ``pid`` ended within ``timeout`` (a zombie nobody reaped has ended:
    an orphaned front end's parent is whatever adopted it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


def _call(world: World, executor: Executor) -> torch.Tensor:
    layer = world.moe_layers[0]
    # A connection the kernel handed to a front end as it died is reset: retried, as any
    # client retries UNAVAILABLE, for a few seconds.
    retry = RetryPolicy(attempts=10, initial_backoff=0.1, max_backoff=1.0)
    with ExecutorClient(executor.address, timeout=30, retry=retry) as client:
        try:
            return client.forward(layer, world.inputs[layer], [(TOKENS, "alpha")]).output
        except MoeLoraError as exc:
            if isinstance(exc, Unavailable):
                raise
            tail = executor.log_path.read_text(errors="replace")[-6000:]
            raise AssertionError(f"{exc}\n{tail}") from exc


def test_requests_over_many_connections_reach_both_front_ends(
    qwen_world: World, executor: Executor
) -> None:
    layer = qwen_world.moe_layers[0]
    expected = qwen_world.expected(layer, [(TOKENS, "alpha")])
    for _ in range(12):  # new connections: the kernel spreads them over both listeners
        assert_close(_call(qwen_world, executor), expected)
    started = executor.events("front_end_started")
    assert len({e["index"] for e in started}) == 2
    assert len({e["address"] for e in started}) == 1, "the front ends must share one port"


def test_a_front_end_that_dies_is_started_again_and_the_other_serves(
    qwen_world: World, executor: Executor
) -> None:
    layer = qwen_world.moe_layers[0]
    expected = qwen_world.expected(layer, [(TOKENS, "alpha")])
    victim = min(executor.front_end_pids())
    os.kill(victim, signal.SIGKILL)
    assert _wait_gone(victim)
    for _ in range(6):  # the survivor answers meanwhile (retried on a refused connection)
        assert_close(_call(qwen_world, executor), expected)
    wait_for(lambda: any(e["pid"] == victim for e in executor.events("front_end_exited")))
    wait_for(lambda: len(executor.front_end_pids()) == 2, timeout=60)
    assert victim not in executor.front_end_pids()
    assert_close(_call(qwen_world, executor), expected)
    with grpc.insecure_channel(executor.address) as channel:
        assert health_check(channel) == "SERVING"


def test_front_ends_exit_when_their_engine_dies(qwen_world: World, executor: Executor) -> None:
    pids = executor.front_end_pids()
    executor.proc.send_signal(signal.SIGKILL)
    executor.proc.wait(30)
    for pid in pids:
        assert _wait_gone(pid, timeout=15), f"front end {pid} outlived its engine"
    exits = executor.events("front_end_exiting")
    assert len(exits) == 2 and all(e["status"] == ENGINE_GONE_EXIT_CODE for e in exits), exits
    with pytest.raises(Unavailable):
        _call(qwen_world, executor)


def test_sigterm_drains_every_process_without_an_error(
    qwen_world: World, executor: Executor
) -> None:
    """A plain stop is no failure: the front ends drain and exit 0, and none reports its
    engine gone (an operator's alert would fire on that line)."""
    _call(qwen_world, executor)
    executor.proc.send_signal(signal.SIGTERM)
    assert executor.proc.wait(60) == 0
    assert not executor.events("front_end_exiting"), executor.events("front_end_exiting")
    errors = [
        line
        for line in executor.log_path.read_text(errors="replace").splitlines()
        if line.startswith("{") and json.loads(line).get("level") == "error"
    ]
    assert not errors, errors
    assert len(executor.events("server_stopped")) >= 1


def test_a_client_that_shrinks_its_shared_memory_gets_an_error_not_the_engine_killed(
    qwen_world: World, executor: Executor
) -> None:
    """A client owns its shared-memory object and may shrink it after registering it. A read
    through a mapping past its end would kill the engine (SIGBUS) for every client; the
    engine reads and writes such memory through the object's descriptor, so the request
    fails FAILED_PRECONDITION and the executor serves on."""
    nbytes = qwen_world.inputs[qwen_world.moe_layers[0]].numpy().nbytes
    ring = Segment.create_unique("moelora-client", 2 * nbytes)
    request = _shared_request(qwen_world, "ring", 0, nbytes)
    try:
        expected = _call(qwen_world, executor)  # the same request, its tensors as bytes
        with grpc.insecure_channel(executor.address) as channel:
            stub = executor_pb2_grpc.ExecutorStub(channel)
            stub.RegisterSharedMemory(
                ex.RegisterSharedMemoryRequest(region="ring", shm_name=ring.name, size=ring.size)
            )
            ring.buffer[:nbytes] = qwen_world.inputs[qwen_world.moe_layers[0]].numpy().tobytes()
            stub.Forward(request, timeout=30)
            assert bytes(ring.buffer[nbytes:]) == expected.numpy().tobytes()  # written back
            os.truncate(SHM_ROOT / ring.name, nbytes // 2)
            with pytest.raises(grpc.RpcError) as info:
                stub.Forward(request, timeout=30)
            assert isinstance(info.value, grpc.Call)
            assert info.value.code() is grpc.StatusCode.FAILED_PRECONDITION
            assert "shrank" in (info.value.details() or "")
        assert executor.proc.poll() is None, "the engine died"
        assert torch.equal(_call(qwen_world, executor), expected)
    finally:
        ring.close()
