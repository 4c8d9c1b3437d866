"""Health while the model loads, client retries, ForwardStream, drain with a Forward in flight,
and the console script end to end (SIGTERM, a checkpoint that fails to load)."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

import grpc
import pytest

from executor_service.sources import LocalFolderSource
from moelora.client.errors import InvalidArgument, MoeLoraError, NotFound, Unavailable
from moelora.client.executor import ExecutorClient, ForwardCall, RetryPolicy
from moelora.client.health import health_check, wait_until_serving
from shared.ports import free_port
from tests.conftest import wait_for
from tests.executor.conftest import GatedSource, StartExecutor, assert_close, slowed_kernel
from tests.executor.worlds import TOKENS, World

SERVICE = "moelora.v1.Executor"


def test_not_serving_until_loaded_and_the_client_retries(
    qwen_world: World, start_executor: StartExecutor
) -> None:
    """Start-up is held inside the preload of an adapter (the source waits at a gate):
    health says NOT_SERVING and RPCs answer UNAVAILABLE until it is opened."""
    gate = threading.Event()
    source = GatedSource(LocalFolderSource(qwen_world.adapter_dir), gate)
    running = start_executor(qwen_world, source=source, wait=False, preload_adapters=["alpha"])
    with grpc.insecure_channel(running.app.address) as channel:
        wait_for(lambda: source.fetches.get("alpha:1") == 1, timeout=30)
        assert health_check(channel, SERVICE) == "NOT_SERVING"
        with pytest.raises(Unavailable, match="loading"):
            running.client.get_executor_info()
        layer = qwen_world.moe_layers[0]
        patient = ExecutorClient(running.app.address, timeout=30, retry=RetryPolicy(attempts=100))
        outcome: list[Any] = []

        def call() -> None:
            outcome.append(patient.forward(layer, qwen_world.inputs[layer], [(TOKENS, "alpha")]))

        caller = threading.Thread(target=call)
        caller.start()
        threading.Event().wait(0.3)  # the client is retrying meanwhile
        gate.set()
        caller.join(30)
        patient.close()
        wait_until_serving(channel, SERVICE, timeout=30)
    assert_close(outcome[0].output, qwen_world.reference[("alpha", layer)])
    preloaded = running.client.list_loaded_adapters().adapters
    assert [(a.name, a.pinned) for a in preloaded] == [("alpha", True)]


def test_a_preload_that_fails_leaves_the_executor_serving(
    qwen_world: World, start_executor: StartExecutor
) -> None:
    running = start_executor(qwen_world, preload_adapters=["nosuch", "alpha"])
    preloaded = running.client.list_loaded_adapters().adapters
    assert [(a.name, a.pinned) for a in preloaded] == [("alpha", True)]
    layer = qwen_world.moe_layers[0]
    result = running.client.forward(layer, qwen_world.inputs[layer], [(TOKENS, None)])
    assert_close(result.output, qwen_world.reference[(None, layer)])


def test_forward_stream_answers_in_order_and_survives_errors(
    qwen_world: World, start_executor: StartExecutor
) -> None:
    client = start_executor(qwen_world).client
    layer = qwen_world.moe_layers[0]
    hidden = qwen_world.inputs[layer]
    calls = [
        ForwardCall(layer, hidden, [(TOKENS, "alpha")]),
        ForwardCall(layer, hidden, [(TOKENS, "nosuch")]),
        ForwardCall(layer, hidden[:, :40]),
        ForwardCall(layer, hidden, [(5, "beta"), (7, None)]),
        ForwardCall(layer, hidden),
    ]
    answers = list(client.forward_stream(calls))
    assert len(answers) == 5
    assert isinstance(answers[1], NotFound) and "nosuch" in str(answers[1])
    assert isinstance(answers[2], InvalidArgument) and "hidden_states.shape" in str(answers[2])
    expected: dict[int, list[tuple[int, str | None]]] = {
        0: [(TOKENS, "alpha")],
        3: [(5, "beta"), (7, None)],
        4: [(TOKENS, None)],
    }
    for index, segments in expected.items():
        answer = answers[index]
        assert not isinstance(answer, MoeLoraError), answer
        assert_close(answer.output, qwen_world.expected(layer, segments))


def test_drain_lets_the_forward_in_flight_finish(
    qwen_world: World, start_executor: StartExecutor
) -> None:
    running = start_executor(qwen_world, kernel=slowed_kernel(1.0))
    layer = qwen_world.moe_layers[0]
    hidden = qwen_world.inputs[layer]
    outcome: list[Any] = []

    def call() -> None:
        with ExecutorClient(running.app.address, timeout=30) as client:
            outcome.append(client.forward(layer, hidden, [(TOKENS, "beta")]))

    caller = threading.Thread(target=call)
    caller.start()

    def in_flight() -> bool:
        return any(a.in_flight for a in running.client.list_loaded_adapters().adapters)

    wait_for(in_flight, timeout=30)
    drainer = threading.Thread(target=running.app.drain)
    drainer.start()
    wait_for(lambda: running.app.server.draining, timeout=10)
    # Refused: UNAVAILABLE ("draining", or the connection refused once the server stopped
    # listening) or, when grpc's shutdown itself turns the call away, CANCELLED.
    with pytest.raises((Unavailable, MoeLoraError)) as refused:
        running.client.forward(layer, hidden)
    assert refused.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
    caller.join(30)
    drainer.join(30)
    assert_close(outcome[0].output, qwen_world.reference[("beta", layer)])


def test_console_script_serves_and_drains_on_sigterm(qwen_world: World, start_server: Any) -> None:
    port = free_port()
    server = start_server(
        "moelora-executor",
        "--listen",
        f"127.0.0.1:{port}",
        "--base-model-path",
        str(qwen_world.checkpoint),
        "--adapter-dir",
        str(qwen_world.adapter_dir),
        "--metrics-listen",
        f"127.0.0.1:{free_port()}",
        "--drain-seconds",
        "5",
        "--device",
        "cpu",  # compared at float32's tolerance
    )
    with ExecutorClient(f"127.0.0.1:{port}", timeout=30) as client:
        client.wait_until_serving(timeout=60)
        layer = qwen_world.moe_layers[-1]
        result = client.forward(layer, qwen_world.inputs[layer], [(TOKENS, "delta")])
        assert_close(result.output, qwen_world.reference[("delta", layer)])
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(30) == 0
    log = server.log()
    for event in ("slot_buffers_allocated", "executor_ready", "server_draining", "server_stopped"):
        assert f'"event": "{event}"' in log, log


def test_console_script_exits_1_when_the_model_cannot_load(
    tmp_path: Path, start_server: Any
) -> None:
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    server = start_server(
        "moelora-executor",
        "--listen",
        f"127.0.0.1:{free_port()}",
        "--base-model-path",
        str(folder),
        "--metrics-listen",
        "",
        "--drain-seconds",
        "1",
    )
    assert server.proc.wait(60) == 1
    assert "base_model_load_failed" in server.log()
    assert "llama" in server.log()
