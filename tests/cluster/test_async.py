"""AsyncClusterClient over real executor processes: layer groups, affinity, failover."""

from __future__ import annotations

import asyncio

import pytest
import torch

from moelora.client.cluster import AsyncClusterClient, ClusterSettings
from moelora.client.errors import Unavailable
from moelora.client.executor import ExecutorClient
from tests.cluster.conftest import RoutingWorld, StartReplicas


def test_async_client_routes_by_layer_and_fails_over(
    routing_world: RoutingWorld, start_replicas: StartReplicas
) -> None:
    first, last = routing_world.moe_layers[0], routing_world.moe_layers[-1]
    head_a, head_b, tail = start_replicas(
        routing_world.checkpoint,
        routing_world.adapter_dir,
        [("127.0.0.1", str(first)), ("127.0.0.1", str(first)), ("127.0.0.1", str(last))],
    )
    hidden = torch.randn(4, routing_world.hidden_size)
    segments: list[tuple[int, str | None]] = [(3, routing_world.adapters[0]), (1, None)]
    with ExecutorClient(tail.address) as direct:
        expected_last = direct.forward(last, hidden, segments).output
    with ExecutorClient(head_b.address) as direct:
        expected_first = direct.forward(first, hidden, segments).output

    async def run() -> None:
        settings = ClusterSettings(eject_seconds=30)
        endpoints = [head_a.address, head_b.address, tail.address]
        async with AsyncClusterClient(endpoints, settings) as cluster:
            assert cluster.layers() == {
                first: sorted([head_a.address, head_b.address]),
                last: [tail.address],
            }
            outs = await asyncio.gather(
                *(cluster.forward(layer, hidden, segments) for layer in (first, last) * 4)
            )
            for index, result in enumerate(outs):
                expected = expected_first if index % 2 == 0 else expected_last
                torch.testing.assert_close(result.output, expected, atol=1e-5, rtol=1e-4)
            head_a.kill()
            head_b_only = [await cluster.forward(first, hidden, segments) for _ in range(4)]
            for result in head_b_only:
                torch.testing.assert_close(result.output, expected_first, atol=1e-5, rtol=1e-4)
            tail.kill()
            with pytest.raises(Unavailable, match=f"layer {last}"):
                await cluster.forward(last, hidden, segments, timeout=5)
            stats = cluster.stats
            assert stats.requests == 12
            assert stats.hits + stats.misses == 12

    asyncio.run(run())
