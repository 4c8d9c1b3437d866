"""A replica whose device faults turns NOT_SERVING, answers UNAVAILABLE naming the fault, and
exits with DEVICE_FAULT_EXIT_CODE; a cluster client over it and a healthy replica loses no
call. Real executor processes, whose kernel faults on a launch of ``FAULT_TOKENS`` rows (a real
illegal memory access on a GPU)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

import pytest
import torch

from executor_service.device_fault import DEVICE_FAULT_EXIT_CODE
from kernels.synthetic import relative_error
from moelora.client.cluster import ClusterClient, ClusterSettings
from moelora.client.errors import Unavailable
from moelora.client.executor import ExecutorClient
from tests.cluster.conftest import RoutingWorld, StartReplicas
from tests.executor.faults import FAULT_TOKENS

THREADS = 4
#: Cluster calls answered before the fault, and after the faulted replica exited.
CALLS_BEFORE = 60
CALLS_AFTER = 60

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
        ],
    ),
]


@pytest.mark.parametrize("device", DEVICES)
def test_a_faulted_replica_exits_and_the_cluster_client_loses_no_call(
    routing_world: RoutingWorld, start_replicas: StartReplicas, device: str
) -> None:
    faulty, healthy = start_replicas(
        routing_world.checkpoint,
        routing_world.adapter_dir,
        [("127.0.0.1", None)] * 2,
        module="tests.executor.faulty_executor",
        device=device,
    )
    layer = routing_world.moe_layers[0]
    hidden = torch.randn(3, routing_world.hidden_size)
    adapters: list[str | None] = [*routing_world.adapters[:4], None]
    with ExecutorClient(healthy.address) as client:
        expected = {a: client.forward(layer, hidden, [(3, a)]).output for a in adapters}
    # bf16 on a GPU: the same kernels in two processes may pick other configs for other T.
    tolerance = 3e-2 if device == "cuda" else 1e-5
    done, failures, wrong = [0], [], []
    lock = threading.Lock()
    stop = threading.Event()
    settings = ClusterSettings(refresh_seconds=0.5, eject_seconds=5.0, timeout=30)
    with ClusterClient([faulty.address, healthy.address], settings) as cluster:

        def work(seed: int) -> None:
            call = seed
            while not stop.is_set():
                adapter = adapters[call % len(adapters)]
                call += THREADS
                try:
                    out = cluster.forward(layer, hidden, [(3, adapter)]).output
                except Exception as exc:
                    with lock:
                        failures.append(repr(exc))
                    continue
                with lock:
                    done[0] += 1
                    if not relative_error(out, expected[adapter]) <= tolerance:
                        wrong.append(adapter)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(THREADS)]
        for thread in threads:
            thread.start()
        try:
            _wait_for(lambda: done[0] >= CALLS_BEFORE)
            with ExecutorClient(faulty.address, timeout=60) as client:
                big = torch.randn(FAULT_TOKENS, routing_world.hidden_size)
                with pytest.raises(Unavailable) as raised:
                    client.forward(layer, big, [(FAULT_TOKENS, None)])
            exit_status = faulty.proc.wait(60)
            after_exit = done[0]
            _wait_for(lambda: done[0] >= after_exit + CALLS_AFTER)
        finally:
            stop.set()
            for thread in threads:
                thread.join(60)
        assert not any(thread.is_alive() for thread in threads), "a client thread hung"
        stats = cluster.stats

    assert failures == [] and wrong == []
    assert done[0] == stats.requests
    assert stats.failovers >= 1, "no call met the faulted replica"
    assert exit_status == DEVICE_FAULT_EXIT_CODE, faulty.log()
    assert healthy.proc.poll() is None
    message = str(raised.value)
    assert "device fault on" in message and "illegal memory access" in message
    events = [json.loads(line) for line in faulty.log().splitlines() if line.startswith("{")]
    faults = [e for e in events if e.get("event") == "device_fault"]
    assert len(faults) == 1 and faults[0]["level"] == "critical", faults
    assert faults[0]["error_id"] in message


def _wait_for(condition: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)
