"""The GPU serving path: CUDA-graph replay equals the eager launch bit for bit, and requests
merged into one launch (graphs, pinned staging) match each request alone within bf16.

Self-contained (a synthetic checkpoint and adapters, no transformers or PEFT), so that it also
runs where only torch and triton are installed: ``pytest --noconftest -m gpu`` on this file.
"""

from __future__ import annotations

import contextlib
import random
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from prometheus_client import CollectorRegistry

from executor_service.app import ExecutorApp
from executor_service.config import ExecutorSettings
from executor_service.graphs import GraphCache
from executor_service.metrics import ExecutorMetrics
from executor_service.model_loader import load_base_model
from executor_service.synthetic import (
    SyntheticAdapter,
    SyntheticBase,
    write_adapter,
    write_base_checkpoint,
)
from kernels import LoRAContext, MoELayerWeights, Routing, moe_forward
from kernels.synthetic import random_slots, relative_error, worst_row_error
from moelora.client.executor import ExecutorClient, ForwardCall, ForwardResult, RetryPolicy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

#: Merged vs alone, both bf16 on the GPU: different launch sizes pick different tile configs
#: (rounding orders), each within the kernels' bf16 bound of the same reference (2e-2).
GPU_BFLOAT16_RELATIVE = 3e-2
TOKENS = 12
#: More adapters than the churn test's slots.
ADAPTERS = ("alpha", "beta", "gamma", "delta", "eps", "zeta", "eta")


@dataclass(frozen=True)
class World:
    checkpoint: Path
    adapter_dir: Path
    layer: int
    layers: tuple[int, ...]
    hidden: torch.Tensor


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    return make_world(tmp_path_factory.mktemp("gpu_world"))


def make_world(root: Path) -> World:
    """A tiny qwen3_moe checkpoint (H = 64) and the ``ADAPTERS`` under ``root``."""
    spec = write_base_checkpoint(
        root / "base", SyntheticBase("qwen3_moe", hidden_size=64, moe_intermediate_size=32)
    )
    for seed, name in enumerate(ADAPTERS):
        write_adapter(root / "adapters" / name, spec, SyntheticAdapter(rank=4), seed=seed)
    hidden = torch.randn(TOKENS, spec.hidden_size, generator=torch.Generator().manual_seed(3))
    return World(root / "base", root / "adapters", spec.moe_layers[0], spec.moe_layers, hidden)


@dataclass
class Running:
    app: ExecutorApp
    client: ExecutorClient
    registry: CollectorRegistry

    def metric(self, name: str, **labels: str) -> float:
        value = self.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value


@contextlib.contextmanager
def _running(world: World, **overrides: object) -> Iterator[Running]:
    settings = ExecutorSettings.model_validate(
        {
            "listen": "127.0.0.1:0",
            "base_model_path": world.checkpoint,
            "adapter_dir": world.adapter_dir,
            "device": "cuda",
            "dtype": "bfloat16",
            "num_slots": 6,
            "max_rank": 8,
            "batch_window_us": 200_000,
            # No tuned table exists for this tiny shape: heuristic configs, no start-up autotune.
            "kernel_autotune_seconds": 0,
            "metrics_listen": "",
            "drain_seconds": 5.0,
            "log_format": "text",
            **overrides,
        }
    )
    registry = CollectorRegistry()
    app = ExecutorApp(settings, ExecutorMetrics(registry))
    app.start()
    client = ExecutorClient(app.address, timeout=120, retry=RetryPolicy(attempts=1))
    try:
        assert app.loaded.wait(120) and app.load_error is None, app.load_error
        yield Running(app, client, registry)
    finally:
        client.close()
        app.drain()


@pytest.fixture
def running(world: World) -> Iterator[Running]:
    with _running(world) as started:
        yield started


def _triton(
    hidden: torch.Tensor, layer: MoELayerWeights, lora: LoRAContext | None, routing: Routing | None
) -> torch.Tensor:
    return moe_forward(hidden, layer, lora, routing, backend="triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_graph_replay_equals_eager_bit_for_bit(world: World, dtype: torch.dtype) -> None:
    device = torch.device("cuda")
    model = load_base_model(world.checkpoint, device, dtype)
    index, layer = next(iter(model.layers.items()))
    h, slots = layer.hidden_size, 3
    generator = torch.Generator().manual_seed(5)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator).to(device, dtype)

    lora = random_slots(layer, slots, rank=4, seed=5)
    graphs = GraphCache(_triton, model.layers, lambda _: lora, device, dtype)
    report = graphs.capture_all()
    # Two per (layer, bucket): host and device input/output.
    assert report.graphs == 2 * len(graphs.buckets) * len(model.layers) and report.failed == 0
    for tokens in (1, 5, 16, 100):
        bucket = graphs.bucket(tokens)
        assert bucket is not None and bucket >= tokens
        graph = graphs.get(index, bucket)
        assert graph is not None, "capture failed"
        x = rand(bucket, h)
        token_slots = torch.randint(-1, slots, (bucket,), generator=generator).to(device)
        token_slots = token_slots.to(torch.int32)
        token_slots[tokens:] = -1
        rows = graphs.staging.fill([x[:tokens].cpu()], token_slots[:tokens].cpu(), bucket)
        assert rows == tokens
        graph.replay()
        eager = _triton(x, layer, LoRAContext(lora, token_slots), None)
        torch.cuda.synchronize()
        # The graph read its input from page-locked staging: x's first rows, then whatever
        # the staging held (rows carrying slot -1, as the eager run's own padding).
        padded = graphs.staging.input[:bucket].to(device)
        padded_eager = _triton(padded, layer, LoRAContext(lora, token_slots), None)
        torch.cuda.synchronize()
        output = graphs.staging.output[:bucket]
        assert torch.equal(output[:tokens], eager[:tokens].cpu()), f"T={tokens} differs"
        assert torch.equal(output, padded_eager.cpu()), f"T={tokens} (bucket {bucket}) differs"


def test_merged_requests_match_each_alone_on_the_gpu(world: World, running: Running) -> None:
    """bf16 serving with graphs and batching: each request merged equals it alone within the
    bf16 tolerance, and launches were graph replays."""
    layer, hidden = world.layer, world.hidden
    mixes: list[list[tuple[int, str | None]]] = [
        [(TOKENS, "alpha")],
        [(5, "beta"), (7, None)],
        [(3, None), (4, "gamma"), (5, "alpha")],
        [(TOKENS, None)],
    ]
    alone = [running.client.forward(layer, hidden, m) for m in mixes]
    merged: dict[int, ForwardResult[torch.Tensor]] = {}
    barrier = threading.Barrier(len(mixes))

    def work(index: int) -> None:
        with ExecutorClient(running.app.address, timeout=60) as client:
            barrier.wait(10)
            merged[index] = client.forward(layer, hidden, mixes[index])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(mixes))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(merged) == len(mixes)
    count = running.metric("moelora_executor_batch_requests_count")
    assert running.metric("moelora_executor_batch_requests_sum") > count, "nothing merged"
    for index, result in merged.items():
        error = worst_row_error(result.output, alone[index].output)
        assert error < GPU_BFLOAT16_RELATIVE, (mixes[index], error)
    assert running.metric("moelora_executor_forward_runs_total", mode="graph") > 0


def test_requests_in_the_pinned_arena_are_read_and_written_in_place(world: World) -> None:
    """bf16 requests whose tensors lie in the front end's page-locked arena launch "mapped":
    the GPU gathers and scatters their rows across the bus, the launch loop copies none. A
    request past the pinned bytes is staged. Every answer equals, bit for bit, the same
    request served with pinning off (the same kernels on the same rows)."""
    small = world.hidden.to(torch.bfloat16)  # 1,536 bytes in and as many out: inside 4 KiB
    large = torch.randn(100, small.shape[1], generator=torch.Generator().manual_seed(4))
    calls: list[tuple[torch.Tensor, list[tuple[int, str | None]]]] = [
        (small, [(TOKENS, "alpha")]),
        (small, [(5, "beta"), (7, None)]),
        (large.to(torch.bfloat16), [(60, "gamma"), (40, None)]),  # 12,800 bytes: past it
        (small[:1], [(1, "alpha")]),
    ]
    io = "moelora_executor_launch_io_total"
    with _running(world, frontend_arena_pinned_bytes=0) as plain:
        expected = [plain.client.forward(world.layer, x, seg).output for x, seg in calls]
        assert plain.metric(io, io="mapped") == 0
        assert plain.metric(io, io="staged") == len(calls)
    with _running(world, frontend_arena_pinned_bytes=4096) as pinned:
        answers = [pinned.client.forward(world.layer, x, seg).output for x, seg in calls]
        assert pinned.metric(io, io="mapped") == len(calls) - 1
        assert pinned.metric(io, io="staged") == 1
    for (x, segments), want, got in zip(calls, expected, answers, strict=True):
        assert got.dtype == torch.bfloat16 and got.shape == x.shape
        assert torch.equal(got, want), segments


def test_requests_in_pinned_shared_memory_are_read_and_written_in_place(world: World) -> None:
    """With --shared-memory-pinned-bytes, a client's registered region is page-locked as it
    is registered and its requests launch "mapped", the launch loop copying none of their
    rows; a region registered once the budget is spent is staged. Every answer equals, bit
    for bit, the same request through an unpinned region."""
    small = world.hidden.to(torch.bfloat16)
    calls: list[tuple[torch.Tensor, list[tuple[int, str | None]]]] = [
        (small, [(TOKENS, "alpha")]),
        (small[:5], [(2, "beta"), (3, None)]),
        (small[:1], [(1, "alpha")]),
    ]
    io = "moelora_executor_launch_io_total"
    h = small.shape[1]

    def through_ring(running: Running) -> list[torch.Tensor]:
        with running.client.shared_memory(h, 64, slots=2) as ring:  # 2 × 2 × 8 KiB
            return [
                running.client.forward(world.layer, x, seg, ring=ring).output for x, seg in calls
            ]

    with _running(world, frontend_arena_pinned_bytes=0, shared_memory_pinned_bytes=0) as plain:
        expected = through_ring(plain)
        assert plain.metric(io, io="mapped") == 0
    with _running(
        world, frontend_arena_pinned_bytes=0, shared_memory_pinned_bytes=32 * 1024
    ) as pinned:
        answers = through_ring(pinned)  # its region takes the whole budget
        assert pinned.metric(io, io="mapped") == len(calls)
        assert pinned.metric(io, io="staged") == 0
        # The budget comes back when the region goes: a new one is pinned again.
        again = through_ring(pinned)
        assert pinned.metric(io, io="mapped") == 2 * len(calls)
        with pinned.client.shared_memory(h, 64, slots=2):  # holds the budget meanwhile
            staged = through_ring(pinned)
        assert pinned.metric(io, io="staged") == len(calls)
    for (x, segments), want, *got in zip(calls, expected, answers, again, staged, strict=True):
        for answer in got:
            assert answer.dtype == torch.bfloat16 and answer.shape == x.shape
            assert torch.equal(answer, want), segments


def test_a_launch_past_the_largest_graph_runs_eagerly_and_matches(
    world: World, running: Running
) -> None:
    """T beyond the largest CUDA-graph bucket runs eagerly (its staging grows past its start-up
    size, its input and output move by the GPU's threads): each row matches the same rows
    served by graphs within bf16."""
    tokens = 600  # past graphs.BUCKETS[-1] and the staging's start-up rows (max_batch_tokens)
    hidden = torch.randn(tokens, world.hidden.shape[1], generator=torch.Generator().manual_seed(9))
    eager_before = running.metric("moelora_executor_forward_runs_total", mode="eager")
    whole = running.client.forward(world.layer, hidden, [(tokens, "alpha")])
    assert running.metric("moelora_executor_forward_runs_total", mode="eager") > eager_before
    parts = [
        running.client.forward(world.layer, hidden[start : start + 100], [(100, "alpha")])
        for start in range(0, tokens, 100)
    ]
    pieced = torch.cat([p.output for p in parts])
    assert relative_error(whole.output, pieced) < GPU_BFLOAT16_RELATIVE
    for start in range(0, tokens, 100):  # no block of rows lost or shifted
        block = slice(start, start + 100)
        assert relative_error(whole.output[block], pieced[block]) < GPU_BFLOAT16_RELATIVE


def test_graphs_reach_max_batch_tokens(world: World) -> None:
    """With --max-batch-tokens past the default, a launch of that many tokens replays its own
    graph (bucket 768), not an eager run, and matches the same rows served in pieces."""
    tokens = 700
    hidden = torch.randn(tokens, world.hidden.shape[1], generator=torch.Generator().manual_seed(5))
    with _running(world, max_batch_tokens=768) as running:
        eager_before = running.metric("moelora_executor_forward_runs_total", mode="eager")
        whole = running.client.forward(world.layer, hidden, [(300, "alpha"), (400, "beta")])
        assert running.metric("moelora_executor_forward_runs_total", mode="eager") == eager_before
        assert running.metric("moelora_executor_graph_replays_total", bucket="768") == 1
        pieces = [
            running.client.forward(world.layer, hidden[:300], [(300, "alpha")]),
            running.client.forward(world.layer, hidden[300:], [(400, "beta")]),
        ]
    pieced = torch.cat([p.output for p in pieces])
    for block in (slice(0, 300), slice(300, tokens)):
        assert relative_error(whole.output[block], pieced[block]) < GPU_BFLOAT16_RELATIVE


def test_graphs_own_their_inputs_through_allocator_churn(world: World) -> None:
    """After capture the caching allocator hands memory around and back to the driver; every
    graph still replays right, and no bystander tensor is written. A graph reads its input and
    slot ids from device buffers its capture wrote to: buffers dropped after the capture would
    be reused or unmapped under it (an illegal memory access while serving)."""
    device, dtype = torch.device("cuda"), torch.bfloat16
    model = load_base_model(world.checkpoint, device, dtype)
    index, layer = next(iter(model.layers.items()))
    h, slots = layer.hidden_size, 3
    generator = torch.Generator().manual_seed(11)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator).to(device, dtype)

    lora = random_slots(layer, slots, rank=4, seed=11)
    graphs = GraphCache(_triton, model.layers, lambda _: lora, device, dtype)
    assert graphs.capture_all().failed == 0
    # Churn: what serving does between replays (loads, eager launches, empty_cache).
    for size in (1, 7, 64, 512, 4096, 1 << 16):
        torch.empty(size * h, dtype=dtype, device=device).fill_(float("nan"))
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    bystanders = [
        torch.full((size, h), 7.0, dtype=dtype, device=device) for size in graphs.buckets * 3
    ]
    for bucket in graphs.buckets:
        graph = graphs.get(index, bucket)
        assert graph is not None
        tokens = max(1, bucket - 1)
        x = rand(tokens, h)
        token_slots = torch.randint(-1, slots, (tokens,), generator=generator).to(torch.int32)
        graphs.staging.fill([x.cpu()], token_slots, pad_to=bucket)
        graph.replay()
        torch.cuda.synchronize()
        eager = _triton(x, layer, LoRAContext(lora, token_slots.to(device)), None)
        error = worst_row_error(graphs.staging.output[:tokens], eager.cpu())
        assert error < GPU_BFLOAT16_RELATIVE, f"bucket {bucket}: worst row error {error:.2e}"
    torch.cuda.synchronize()
    assert all(bool((b == 7.0).all()) for b in bystanders), "a replay wrote into another tensor"


def test_many_clients_across_buckets_layers_and_slot_churn(world: World) -> None:
    """Eight client threads, each on its own channel with its own inputs: token counts on both
    sides of bucket edges, both MoE layers, more adapters than slots (loads race replays),
    unary and streams. Every answer matches the same request served alone, row by row."""
    rng = random.Random(5)
    requests = []
    for i in range(24):
        tokens = rng.choice([1, 2, 3, 7, 8, 9, 15, 17, 31, 33, 63, 65, 127, 129, 255, 257, 511])
        adapters: list[str | None] = [*ADAPTERS, None]
        split = rng.randint(1, tokens) if tokens > 1 else tokens
        segments = [(split, rng.choice(adapters))]
        if split < tokens:
            segments.append((tokens - split, rng.choice(adapters)))
        hidden = torch.randn(
            tokens, world.hidden.shape[1], generator=torch.Generator().manual_seed(i)
        )
        requests.append((rng.choice(world.layers), hidden, segments))
    with _running(world, num_slots=3, batch_window_us=2000, slot_wait_seconds=60) as running:
        alone = [running.client.forward(layer, x, seg).output for layer, x, seg in requests]
        errors: dict[tuple[int, int], float] = {}
        failures: list[BaseException] = []

        def work(client_index: int) -> None:
            order = random.Random(client_index).sample(range(len(requests)), len(requests))
            try:
                with ExecutorClient(running.app.address, timeout=120) as client:
                    if client_index % 2:
                        calls = [ForwardCall(*requests[i]) for i in order]
                        answers = list(client.forward_stream(calls))
                    else:
                        answers = [client.forward(*requests[i]) for i in order]
                for i, answer in zip(order, answers, strict=True):
                    assert isinstance(answer, ForwardResult), answer
                    errors[(client_index, i)] = worst_row_error(answer.output, alone[i])
            except BaseException as exc:
                failures.append(exc)

        threads = [threading.Thread(target=work, args=(c,)) for c in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
        assert not any(t.is_alive() for t in threads), "a client thread hung"
        assert not failures, failures
        assert len(errors) == 8 * len(requests), "a client did not report every answer"
        worst = max(errors.values())
        assert worst < GPU_BFLOAT16_RELATIVE, f"worst row error {worst:.2e}"
        assert running.metric("moelora_executor_adapter_evictions_total", tier="gpu") > 0
        merged = running.metric("moelora_executor_batch_requests_sum")
        assert merged > running.metric("moelora_executor_batch_requests_count"), "none merged"
        assert running.metric("moelora_executor_forward_runs_total", mode="eager") == 0
        listing = running.client.list_loaded_adapters().adapters
        assert all(a.in_flight == 0 for a in listing)
