"""More adapters than GPU slots, requested concurrently from several client threads."""

from __future__ import annotations

import random
import threading

from executor_service.sources import LocalFolderSource
from moelora.client.executor import ExecutorClient
from tests.executor.conftest import (
    GatedSource,
    StartExecutor,
    assert_close,
    slowed_kernel,
)
from tests.executor.worlds import TOKENS, World

PINNED = "gamma"
UNPINNED = ["alpha", "beta", "delta", "eps", "zeta", "eta"]
THREADS = 4
REQUESTS_PER_THREAD = 8


def _random_segments(rng: random.Random) -> list[tuple[int, str | None]]:
    """Up to two unpinned adapters, maybe the pinned one and the base model, in random
    runs covering TOKENS tokens."""
    names: list[str | None] = rng.sample(UNPINNED, rng.randint(1, 2))
    if rng.random() < 0.5:
        names.append(PINNED)
    if rng.random() < 0.5:
        names.append(None)
    rng.shuffle(names)
    cuts = sorted(rng.sample(range(1, TOKENS), len(names) - 1))
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, TOKENS], strict=True)]
    return list(zip(sizes, names, strict=True))


def test_churn_every_output_correct_pinned_never_evicted(
    qwen_world: World, start_executor: StartExecutor
) -> None:
    """3 slots, one pinned, six other adapters from four threads: slots are evicted and
    rewritten all the time. The kernel is entered 20 ms after a request acquired its slots,
    so a slot overwritten while still in use would show as a wrong output."""
    running = start_executor(
        qwen_world, num_slots=3, kernel=slowed_kernel(0.02), slot_wait_seconds=60
    )
    pinned = running.client.pin_adapter(PINNED)
    failures: list[BaseException] = []

    def work(seed: int) -> None:
        rng = random.Random(seed)
        with ExecutorClient(running.app.address, timeout=60) as client:
            for _ in range(REQUESTS_PER_THREAD):
                layer = rng.choice(qwen_world.moe_layers)
                segments = _random_segments(rng)
                try:
                    result = client.forward(layer, qwen_world.inputs[layer], segments)
                    assert_close(result.output, qwen_world.expected(layer, segments))
                    assert result.resolved_adapters == [f"{n}:1" if n else "" for _, n in segments]
                except BaseException as exc:
                    failures.append(exc)
                    return

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not failures, failures[0]
    assert running.slots()[f"{PINNED}:1"] == pinned.slot
    listing = {a.name: a for a in running.client.list_loaded_adapters().adapters}
    assert listing[PINNED].pinned
    assert all(a.in_flight == 0 for a in listing.values())
    assert running.metric("moelora_executor_adapter_evictions_total", tier="gpu") >= 4
    # Every adapter was fetched and packed once, then served from the host cache.
    assert running.metric("moelora_executor_adapter_misses_total", tier="host") == 7


def test_one_load_per_digest_however_many_ask_at_once(
    qwen_world: World, start_executor: StartExecutor
) -> None:
    gate = threading.Event()
    source = GatedSource(LocalFolderSource(qwen_world.adapter_dir), gate)
    running = start_executor(qwen_world, source=source)
    layer = qwen_world.moe_layers[0]
    results: list[object] = []

    def ask(index: int) -> None:
        with ExecutorClient(running.app.address, timeout=60) as client:
            if index % 2:
                results.append(client.load_adapter("alpha", to_gpu=True).slot)
            else:
                out = client.forward(layer, qwen_world.inputs[layer], [(TOKENS, "alpha")])
                assert_close(out.output, qwen_world.reference[("alpha", layer)])
                results.append(out.resolved_adapters)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    # Let every request reach the source before it answers.
    threading.Event().wait(0.5)
    gate.set()
    for thread in threads:
        thread.join(60)
    assert len(results) == 6
    assert source.fetches == {"alpha:1": 1}


def test_a_request_waiting_for_its_adapter_holds_up_no_other(
    qwen_world: World, start_executor: StartExecutor
) -> None:
    """The launch loop prepares requests whose adapters are at hand; one whose adapter must
    be fetched waits on a worker thread, so the base request behind it is answered first."""
    gate = threading.Event()
    source = GatedSource(LocalFolderSource(qwen_world.adapter_dir), gate)
    running = start_executor(qwen_world, source=source)
    layer = qwen_world.moe_layers[0]
    cold: list[object] = []

    def ask_cold() -> None:
        with ExecutorClient(running.app.address, timeout=60) as client:
            out = client.forward(layer, qwen_world.inputs[layer], [(TOKENS, "alpha")])
            assert_close(out.output, qwen_world.reference[("alpha", layer)])
            cold.append(out.resolved_adapters)

    thread = threading.Thread(target=ask_cold)
    thread.start()
    while not source.fetches:  # the cold request reached the source and is held there
        threading.Event().wait(0.01)
    with ExecutorClient(running.app.address, timeout=20) as client:
        out = client.forward(layer, qwen_world.inputs[layer], [(TOKENS, None)])
    assert not gate.is_set() and not cold
    assert_close(out.output, qwen_world.reference[(None, layer)])
    gate.set()
    thread.join(60)
    assert cold == [["alpha:1"]]
