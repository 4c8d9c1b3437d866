"""Admin RPCs, reference resolution, both cache tiers, GetExecutorInfo and the metrics."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from moelora.client.errors import FailedPrecondition, NotFound, ResourceExhausted
from moelora.client.executor import ExecutorClient
from moelora.client.model_spec import read_model_spec
from moelora.v1 import executor_pb2, tensor_pb2
from tests.conftest import wait_for
from tests.executor.conftest import MULTI, StartExecutor, assert_close, slowed_kernel
from tests.executor.worlds import TOKENS, World

GPU = executor_pb2.ADAPTER_LOCATION_GPU
HOST = executor_pb2.ADAPTER_LOCATION_HOST


def test_load_pin_unpin_unload(qwen_world: World, start_executor: StartExecutor) -> None:
    running = start_executor(qwen_world)
    client = running.client
    on_host = client.load_adapter("alpha")
    assert (on_host.location, on_host.slot, on_host.version) == (HOST, -1, 1)
    assert on_host.digest.startswith("sha256:") and on_host.size_bytes > 0
    assert on_host.rank == 4
    assert running.metric("moelora_executor_adapter_resident", adapter="alpha:1", tier="host")
    on_gpu = client.load_adapter("alpha", to_gpu=True)
    assert on_gpu.location == GPU and on_gpu.slot >= 0 and on_gpu.in_flight == 0
    assert running.metric("moelora_executor_adapter_resident", adapter="alpha:1", tier="gpu")

    pinned = client.pin_adapter("alpha")
    assert pinned.pinned and pinned.slot == on_gpu.slot
    with pytest.raises(FailedPrecondition, match="pinned"):
        client.unload_adapter("alpha")
    assert not client.unpin_adapter("alpha").pinned

    dropped = client.unload_adapter("alpha")
    assert dropped.name == "alpha" and dropped.location == GPU
    listing = client.list_loaded_adapters()
    assert [a.name for a in listing.adapters] == []
    assert (listing.num_slots, listing.free_slots, listing.host_cache_used_bytes) == (4, 4, 0)
    assert not running.metric("moelora_executor_adapter_resident", adapter="alpha:1", tier="gpu")
    with pytest.raises(NotFound, match="not loaded"):
        client.unload_adapter("alpha")
    with pytest.raises(NotFound):
        client.load_adapter("nosuch")


def test_pinning_keeps_one_slot_free(qwen_world: World, start_executor: StartExecutor) -> None:
    running = start_executor(qwen_world, num_slots=4)
    client = running.client
    slots = {client.pin_adapter(name).slot for name in ("alpha", "beta", "gamma")}
    assert len(slots) == 3
    with pytest.raises(ResourceExhausted, match="one must stay unpinned"):
        client.pin_adapter("delta")
    layer = qwen_world.moe_layers[0]
    hidden = qwen_world.inputs[layer]
    # The one unpinned slot serves any one other adapter, with the pinned ones alongside.
    for name in ("delta", "eps"):
        segments: list[tuple[int, str | None]] = [(6, name), (6, "alpha")]
        result = client.forward(layer, hidden, segments)
        assert_close(result.output, qwen_world.expected(layer, segments))
    with pytest.raises(ResourceExhausted, match="split the request"):
        client.forward(layer, hidden, [(6, "delta"), (6, "eps")])
    assert {running.slots()[f"{n}:1"] for n in ("alpha", "beta", "gamma")} == slots


def test_gpu_slots_evict_least_recently_used(
    qwen_world: World, start_executor: StartExecutor
) -> None:
    running = start_executor(qwen_world, num_slots=2)
    client = running.client
    layer = qwen_world.moe_layers[0]
    hidden = qwen_world.inputs[layer]
    client.load_adapter("alpha", to_gpu=True)
    client.load_adapter("beta", to_gpu=True)
    client.forward(layer, hidden, [(TOKENS, "alpha")])  # beta is now the least recent
    client.load_adapter("gamma", to_gpu=True)
    assert set(running.slots()) == {"alpha:1", "gamma:1"}
    # beta left its slot but stays packed in the host cache.
    locations = {a.name: a.location for a in client.list_loaded_adapters().adapters}
    assert locations == {"alpha": GPU, "gamma": GPU, "beta": HOST}
    assert running.metric("moelora_executor_adapter_evictions_total", tier="gpu") == 1
    assert running.metric("moelora_executor_adapter_hits_total", tier="gpu") == 1
    assert running.metric("moelora_executor_gpu_slots", state="free") == 0


def test_host_cache_keeps_its_byte_budget(qwen_world: World, start_executor: StartExecutor) -> None:
    probe = start_executor(qwen_world).client.load_adapter("alpha").size_bytes
    running = start_executor(qwen_world, host_cache_bytes=2 * probe)
    client = running.client
    for name in ("alpha", "eta", "zeta", "alpha"):
        client.load_adapter(name)
    listing = client.list_loaded_adapters()
    assert listing.host_cache_used_bytes <= 2 * probe
    assert "alpha" in {a.name for a in listing.adapters}
    assert running.metric("moelora_executor_adapter_evictions_total", tier="host") >= 1
    # Larger than the whole budget: kept on the GPU only, refused for the host alone.
    tiny = start_executor(qwen_world, host_cache_bytes=probe // 2).client
    with pytest.raises(ResourceExhausted, match="budget"):
        tiny.load_adapter("alpha")
    assert tiny.load_adapter("alpha", to_gpu=True).location == GPU


def test_host_cache_churn_recycles_its_memory(
    qwen_world: World, start_executor: StartExecutor
) -> None:
    """Fifteen loads through a cache that holds two: each evicted adapter's memory goes back
    to the pool and the next pack takes it, so no pack needs fresh memory and the pool stays
    within its first slab (fifteen adapters would not fit in it)."""
    probe = start_executor(qwen_world).client.load_adapter("alpha").size_bytes
    running = start_executor(qwen_world, host_cache_bytes=2 * probe)
    names = ("alpha", "eta", "zeta") * 5
    for name in names:
        running.client.load_adapter(name)
    assert running.metric("moelora_executor_adapter_evictions_total", tier="host") >= 10
    mapped = running.metric("moelora_executor_host_pool_mapped_bytes")
    assert 0 < mapped < len(names) * probe
    assert 0 < running.metric("moelora_executor_host_pool_used_bytes") <= mapped
    assert running.metric("moelora_executor_host_pool_overflow_bytes_total") == 0


def test_references_resolve_to_versions_keyed_by_digest(
    qwen_world: World, start_executor: StartExecutor
) -> None:
    client = start_executor(qwen_world).client
    layer = qwen_world.moe_layers[0]
    hidden = qwen_world.inputs[layer]
    newest = client.forward(layer, hidden, [(TOKENS, MULTI)])
    assert newest.resolved_adapters == [f"{MULTI}:2"]
    assert_close(newest.output, qwen_world.reference[("beta", layer)])
    first = client.forward(layer, hidden, [(TOKENS, f"{MULTI}:1")])
    assert_close(first.output, qwen_world.reference[("alpha", layer)])
    digest = {
        a.version: a.digest for a in client.list_loaded_adapters().adapters if a.name == MULTI
    }
    assert len(digest) == 2 and digest[1] != digest[2]
    by_digest = client.forward(layer, hidden, [(TOKENS, f"{MULTI}@{digest[1]}")])
    assert by_digest.resolved_adapters == [f"{MULTI}:1"]
    # alpha and multi:1 have identical files, hence the same digest: one slot holds both.
    alpha = client.load_adapter("alpha", to_gpu=True)
    assert alpha.digest == digest[1]
    with pytest.raises(NotFound, match="no aliases"):
        client.forward(layer, hidden, [(TOKENS, f"{MULTI}@prod")])


def test_executor_info(qwen_world: World, start_executor: StartExecutor) -> None:
    info = start_executor(qwen_world, num_slots=3, max_rank=8).client.get_executor_info()
    spec = read_model_spec(qwen_world.checkpoint)
    assert info.backend == "torch-reference" and info.device == "cpu"
    assert info.compute_dtype == tensor_pb2.DATA_TYPE_FLOAT32
    assert info.base_model.fingerprint == spec.fingerprint
    assert list(info.base_model.moe_layers) == list(qwen_world.moe_layers)
    assert info.base_model.name == "base"  # the folder's name
    assert (info.num_slots, info.max_rank, info.max_tokens_per_request) == (3, 8, 16384)
    h, i, e = spec.hidden_size, spec.moe_intermediate_size, spec.num_experts
    per_layer = 3 * e * 8 * (2 * h + 3 * i) * 4 + 3 * 4  # float32 buffers + int32 enabled
    assert info.slot_memory_bytes == len(qwen_world.moe_layers) * per_layer
    assert info.server_version
    assert list(info.kernel_configs) == []  # the torch reference launches no kernels


def test_forward_metrics(qwen_world: World, start_executor: StartExecutor) -> None:
    running = start_executor(qwen_world)
    layer = qwen_world.moe_layers[0]
    hidden = qwen_world.inputs[layer].to(torch.float32)
    for _ in range(2):
        running.client.forward(layer, hidden, [(8, "alpha"), (4, None)])
    assert running.metric("moelora_executor_forward_tokens_total", kind="lora") == 16
    assert running.metric("moelora_executor_forward_tokens_total", kind="base") == 8
    assert running.metric("moelora_executor_forward_seconds_count") == 2
    assert running.metric("moelora_executor_adapter_misses_total", tier="gpu") == 1
    assert running.metric("moelora_executor_adapter_hits_total", tier="gpu") == 1
    assert running.metric("moelora_executor_adapter_load_bytes_total", tier="host") > 0


def test_unload_waits_for_the_requests_in_flight(
    qwen_world: World, start_executor: StartExecutor
) -> None:
    slow = slowed_kernel(0.5)
    kernel_done = threading.Event()

    def kernel(*args: Any) -> torch.Tensor:
        out = slow(*args)
        kernel_done.set()
        return out

    running = start_executor(qwen_world, kernel=kernel)
    layer = qwen_world.moe_layers[0]
    hidden = qwen_world.inputs[layer]
    outcome: list[torch.Tensor] = []

    def call() -> None:
        with ExecutorClient(running.app.address, timeout=30) as client:
            outcome.append(client.forward(layer, hidden, [(TOKENS, "eta")]).output)

    caller = threading.Thread(target=call)
    caller.start()
    wait_for(lambda: "eta:1" in running.slots(), timeout=30)
    dropped = running.client.unload_adapter("eta")
    assert kernel_done.is_set(), "UnloadAdapter returned while a Forward still used the adapter"
    caller.join(30)
    assert dropped.in_flight == 0 and running.slots() == {}
    assert_close(outcome[0], qwen_world.reference[("eta", layer)])
