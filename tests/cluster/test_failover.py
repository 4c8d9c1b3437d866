"""Failover over real executor processes: a replica killed in the middle of a stream of 500
requests fails none of them, and a replica that leaves DNS stops getting traffic before it
stops."""

from __future__ import annotations

import random
import threading

import torch

from moelora.client.cluster import ClusterClient, ClusterSettings
from moelora.client.executor import ExecutorClient
from shared.ports import free_port
from tests.cluster.conftest import RoutingWorld, StartReplicas

REQUESTS = 500
THREADS = 4
KILL_AFTER = 150


def _calls(world: RoutingWorld, count: int, seed: int) -> list[tuple[int, str | None]]:
    rng = random.Random(seed)
    names: list[str | None] = [*world.adapters[:6], None]
    return [(rng.choice(world.moe_layers), rng.choice(names)) for _ in range(count)]


def _expected(
    address: str, world: RoutingWorld, hidden: torch.Tensor
) -> dict[object, torch.Tensor]:
    """Every (layer, adapter) output from one replica directly: the answers to compare with."""
    with ExecutorClient(address) as client:
        return {
            (layer, adapter): client.forward(layer, hidden, [(len(hidden), adapter)]).output
            for layer in world.moe_layers
            for adapter in [*world.adapters[:6], None]
        }


def test_killing_a_replica_fails_no_request(
    routing_world: RoutingWorld, start_replicas: StartReplicas
) -> None:
    first, second = start_replicas(
        routing_world.checkpoint, routing_world.adapter_dir, [("127.0.0.1", None)] * 2
    )
    hidden = torch.randn(3, routing_world.hidden_size)
    expected = _expected(second.address, routing_world, hidden)
    calls = _calls(routing_world, REQUESTS, seed=2)
    done, failures, wrong = [0], [], []
    lock = threading.Lock()
    killed = threading.Event()
    settings = ClusterSettings(refresh_seconds=0.5, eject_seconds=5.0, timeout=30)

    with ClusterClient([first.address, second.address], settings) as cluster:

        def work(part: list[tuple[int, str | None]]) -> None:
            for layer, adapter in part:
                try:
                    out = cluster.forward(layer, hidden, [(len(hidden), adapter)]).output
                except Exception as exc:
                    with lock:
                        failures.append(repr(exc))
                    continue
                with lock:
                    done[0] += 1
                    if not torch.allclose(out, expected[(layer, adapter)], atol=1e-5, rtol=1e-4):
                        wrong.append((layer, adapter))
                    if done[0] == KILL_AFTER and not killed.is_set():
                        killed.set()
                        first.kill()

        threads = [threading.Thread(target=work, args=(calls[i::THREADS],)) for i in range(THREADS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        stats = cluster.stats

    print(f"\n{REQUESTS} requests, replica killed after {KILL_AFTER}: {stats}")
    assert killed.is_set()
    assert failures == []
    assert wrong == []
    assert done[0] == REQUESTS == stats.requests
    assert stats.failovers >= 1


def test_replica_leaving_dns_gets_no_more_traffic(
    routing_world: RoutingWorld, start_replicas: StartReplicas
) -> None:
    """Two replicas on 127.0.0.2 and 127.0.0.3 behind one name, as a headless Service's pods
    are; the test plays DNS by changing what the name resolves to."""
    port = free_port()
    records = {"executors.test": ["127.0.0.2", "127.0.0.3"]}
    start_replicas(
        routing_world.checkpoint,
        routing_world.adapter_dir,
        [("127.0.0.2", None), ("127.0.0.3", None)],
        port=port,
    )
    settings = ClusterSettings(refresh_seconds=3600)  # refreshed by hand below

    def resolver(host: str, _port: int) -> list[str]:
        return list(records[host])

    hidden = torch.randn(2, routing_world.hidden_size)
    with ClusterClient([f"dns:///executors.test:{port}"], settings, resolver) as cluster:
        layer = routing_world.moe_layers[0]
        assert cluster.layers()[layer] == [f"127.0.0.2:{port}", f"127.0.0.3:{port}"]
        for adapter in routing_world.adapters:
            cluster.forward(layer, hidden, [(2, adapter)])

        records["executors.test"] = ["127.0.0.2"]
        cluster.refresh()
        assert cluster.layers()[layer] == [f"127.0.0.2:{port}"]
        with ExecutorClient(f"127.0.0.3:{port}") as gone:
            before = gone.list_loaded_adapters()
            for adapter in routing_world.adapters:
                cluster.forward(layer, hidden, [(2, adapter)])
            after = gone.list_loaded_adapters()
        assert [a.last_used_time for a in after.adapters] == [
            a.last_used_time for a in before.adapters
        ]
        assert cluster.stats.failovers == 0

        records["executors.test"] = ["127.0.0.2", "127.0.0.3"]
        cluster.refresh()
        assert len(cluster.layers()[layer]) == 2
