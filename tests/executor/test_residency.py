"""Residency for routers: ForwardResponse says whether the adapters were resident and how many
were loaded, and ``moelora_executor_lora_requests_info`` lists the adapters in GPU slots in
vLLM's ``lora_requests_info`` convention."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from tests.executor.conftest import StartExecutor
from tests.executor.worlds import TOKENS, World

INFO = "moelora_executor_lora_requests_info"


def _running(registry: CollectorRegistry) -> tuple[set[str], str, str]:
    samples = [s for metric in registry.collect() for s in metric.samples if s.name == INFO]
    assert len(samples) == 1, samples
    labels = samples[0].labels
    running = set(filter(None, labels["running_lora_adapters"].split(",")))
    return running, labels["waiting_lora_adapters"], labels["max_lora"]


def test_forward_reports_residency_and_gauge_lists_slots(
    qwen_world: World, start_executor: StartExecutor
) -> None:
    running = start_executor(qwen_world, num_slots=2)
    layer = qwen_world.moe_layers[0]
    hidden = qwen_world.inputs[layer]
    assert _running(running.registry) == (set(), "", "2")

    first = running.client.forward(layer, hidden, [(TOKENS - 2, "alpha"), (2, "beta")])
    assert (first.adapters_resident, first.adapters_loaded) == (False, 2)
    again = running.client.forward(layer, hidden, [(TOKENS, "beta")])
    assert (again.adapters_resident, again.adapters_loaded) == (True, 0)
    base = running.client.forward(layer, hidden)
    assert (base.adapters_resident, base.adapters_loaded) == (True, 0)
    assert _running(running.registry)[0] == {"alpha:1", "beta:1"}

    evicting = running.client.forward(layer, hidden, [(TOKENS, "gamma")])
    assert (evicting.adapters_resident, evicting.adapters_loaded) == (False, 1)
    assert _running(running.registry)[0] == {"beta:1", "gamma:1"}  # alpha was the LRU
