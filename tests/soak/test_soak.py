"""Soak: many client processes through few slots while adapters move and go. Every output is
compared with transformers + PEFT; counts by status, p50/p99, the servers' RSS and open file
descriptors over time, and the pinned adapters' slots are reported and checked. ``make soak``:
32 processes, 64 adapters, 8 slots, >= 10,000 calls; ``make test`` runs a small seeded form."""

from __future__ import annotations

import dataclasses
import multiprocessing
import statistics
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.executor.worlds import Recipe, build_world
from tests.live_stack import BASE, Stack, file_targets, open_fds, open_files, rss_bytes
from tests.soak.client_process import Outcome, Plan, run

pytestmark = pytest.mark.timeout(1800)

VARIANTS = ["both", "down_only", "gate_up_only", "rslora", "target_modules", "patterns"]
PINNED = ("a0", "a1")
MOVING = "mv"


@dataclass(frozen=True)
class Size:
    processes: int
    adapters: int
    slots: int
    calls_per_process: int


def _size(request: pytest.FixtureRequest) -> Size:
    if request.config.getoption("--long"):
        size = Size(processes=32, adapters=64, slots=8, calls_per_process=320)
    else:
        size = Size(processes=3, adapters=10, slots=5, calls_per_process=40)
    calls = request.config.getoption("--soak-calls")
    return dataclasses.replace(size, calls_per_process=calls) if calls else size


@pytest.fixture(scope="module")
def size(request: pytest.FixtureRequest) -> Size:
    return _size(request)


@pytest.fixture(scope="module")
def stack(size: Size, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("soak")
    recipes = [Recipe(f"a{i}", VARIANTS[i % len(VARIANTS)], i + 1) for i in range(size.adapters)]
    world = build_world("qwen3_moe", tmp / "world", recipes)
    stack = Stack(
        world,
        tmp,
        executor_flags=("--num-slots", str(size.slots), "--max-rank", "8"),
        registry_flags=("--watch-poll-seconds", "0.1"),
    )
    try:
        stack.start([r.name for r in recipes])
        yield stack
    finally:
        stack.stop()


class Sampler:
    """RSS and open fds of both servers, and the pinned adapters' slots, once a second."""

    def __init__(self, stack: Stack) -> None:
        assert stack.executor is not None and stack.registry is not None
        self._pids = {"executor": stack.executor.proc.pid, "registry": stack.registry.proc.pid}
        self._stack = stack
        self.samples: list[dict[str, int]] = []
        self.pinned_slots: list[dict[str, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def pid(self, server: str) -> int:
        return self._pids[server]

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        with self._stack.executor_client(attempts=4) as client:
            while not self._stop.wait(1.0):
                sample = {}
                for name, pid in self._pids.items():
                    sample[f"{name}_rss"] = rss_bytes(pid)
                    sample[f"{name}_fds"] = open_fds(pid)
                    sample[f"{name}_files"] = open_files(pid)
                self.samples.append(sample)
                loaded = client.list_loaded_adapters().adapters
                self.pinned_slots.append({a.name: a.slot for a in loaded if a.pinned})


def _mutate(stack: Stack, stop: threading.Event, log: list[str]) -> None:
    """Uploads new versions of MOVING (odd: a2's weights, even: a3's), moves its alias to the
    newest, deletes the version before the previous one; also moves ``a4@live`` around."""
    folders = {1: stack.world.adapter_dir / "a2", 0: stack.world.adapter_dir / "a3"}
    with stack.registry_client() as client:
        version = client.upload(folders[1], MOVING, BASE).version
        client.set_alias(MOVING, "live", version)
        client.set_alias("a4", "live", 1)
        while not stop.wait(0.5):
            version = client.upload(folders[(version + 1) % 2], MOVING, BASE).version
            client.set_alias(MOVING, "live", version)
            if version > 2:
                client.delete(f"{MOVING}:{version - 2}")
            log.append(f"{MOVING}:{version}")


def test_soak(stack: Stack, size: Size) -> None:
    with stack.executor_client() as client:
        pinned = {name: client.pin_adapter(name).slot for name in PINNED}
    refs = tuple([f"a{i}" for i in range(size.adapters)] + [MOVING, f"{MOVING}@live", "a4@live"])
    folders = {f"a{i}:1": f"a{i}" for i in range(size.adapters)}
    plans = [
        Plan(stack.executor_address, stack.world, refs, folders, MOVING, "a2", "a3",
             size.calls_per_process, seed)
        for seed in range(size.processes)
    ]  # fmt: skip
    stop = threading.Event()
    moves: list[str] = []
    mutator = threading.Thread(target=_mutate, args=(stack, stop, moves), daemon=True)
    start = time.monotonic()
    with Sampler(stack) as sampler:
        mutator.start()
        time.sleep(1.0)  # the first version of MOVING and its alias exist
        context = multiprocessing.get_context("spawn")
        with context.Pool(size.processes) as pool:
            outcomes: list[Outcome] = pool.map(run, plans)
        stop.set()
        mutator.join(30)
    seconds = time.monotonic() - start

    statuses: Counter[str] = Counter()
    for outcome in outcomes:
        statuses.update(outcome.statuses)
    latencies = sorted(ms for o in outcomes for ms in o.latencies_ms)
    wrong = sum(o.wrong for o in outcomes)
    calls = sum(statuses.values())
    p50 = statistics.median(latencies)
    p99 = latencies[int(len(latencies) * 0.99) - 1]
    first, last = sampler.samples[min(2, len(sampler.samples) - 1)], sampler.samples[-1]
    print(
        f"\nsoak: {size.processes} processes x {size.calls_per_process} calls, {size.adapters} "
        f"adapters + {MOVING} ({len(moves)} versions uploaded, moved, deleted), {size.slots} "
        f"slots, {seconds:.0f} s\n  statuses {dict(statuses)}; wrong outputs {wrong}; "
        f"p50 {p50:.1f} ms, p99 {p99:.1f} ms"
    )
    series = sampler.samples
    for key in first:
        # Tenths of the run (the calls go at a steady rate, so also tenths of the calls).
        tenths = [series[min(len(series) - 1, len(series) * q // 10)][key] for q in range(1, 10)]
        print(f"  {key}: {first[key]} -> {tenths} -> {last[key]} "
              f"(max {max(s[key] for s in series)})")  # fmt: skip

    assert calls == size.processes * size.calls_per_process
    assert wrong == 0
    # NOT_FOUND only for a version of MOVING deleted while a call held it.
    assert set(statuses) <= {"OK", "NOT_FOUND"}, (statuses, [o.errors[:3] for o in outcomes])
    assert all(MOVING in ref for o in outcomes for ref in o.not_found_refs)
    assert statuses["OK"] >= 0.99 * calls
    # Pinned adapters never left their slots.
    assert all(slots == pinned for slots in sampler.pinned_slots), sampler.pinned_slots[-1]
    # What grows with calls is a leak; what fills while the run warms up (caches, the
    # database's connection pool, threads) levels off: the run's last third may not outgrow
    # its middle third. Sockets are not counted: they are the clients' connections, open or
    # kept alive, as many as there are clients, not calls.
    middle, end = series[len(series) // 3 : 2 * len(series) // 3], series[2 * len(series) // 3 :]
    for server in ("executor", "registry"):
        for key, slack in ((f"{server}_rss", 1.05), (f"{server}_files", 1.0)):
            grown = max(s[key] for s in end)
            bound = max(s[key] for s in middle) * slack + (2 if key.endswith("files") else 0)
            if grown > bound and key.endswith("files"):
                # A leaked descriptor stays open; one of a call or download in flight at the
                # sample (a poller's eventfd and epoll, a pipe) has gone by now.
                grown = open_files(sampler.pid(server))
            assert grown <= bound, (
                f"{key} grew from {bound} to {grown} late in the run; open now: "
                f"{sorted(file_targets(sampler.pid(server)))}"
            )
