"""Serving through a control-plane outage, with a real registry process stopped, frozen and
restarted under a real executor process: alias Forwards keep being answered, one WARNING per
outage, references never resolved fail fast, an alias moved meanwhile is picked up when the
registry returns, a restarted executor serves what its disk cache held, and an executor
refused the change stream re-checks what it serves."""

from __future__ import annotations

import os
import signal
import statistics
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from moelora.client.errors import NotFound, Unavailable
from moelora.client.executor import ExecutorClient, RetryPolicy
from shared.ports import free_port
from tests.conftest import ServerProcess, wait_for
from tests.executor.conftest import assert_close
from tests.executor.worlds import Recipe, World, build_world
from tests.live_stack import BASE, Stack

pytestmark = pytest.mark.timeout(240)

#: Short enough that the tests see answers go stale.
STALENESS = "1"
CALLS = 30
BLOCKS = 5


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    recipes = [Recipe("alpha", "both", 1), Recipe("beta", "down_only", 2)]
    return build_world("qwen3_moe", tmp_path_factory.mktemp("outage_world"), recipes)


@pytest.fixture
def stack(world: World, tmp_path: Path) -> Iterator[Stack]:
    stack = Stack(
        world,
        tmp_path,
        executor_flags=(
            *("--registry-staleness-seconds", STALENESS),
            *("--metrics-listen", f"127.0.0.1:{free_port()}"),
        ),
        registry_flags=("--gc-interval-seconds", "0"),
    )
    try:
        yield stack
    finally:
        stack.stop()


def _outage_gauge(stack: Stack) -> float:
    """moelora_executor_registry_outage_start_timestamp_seconds, scraped from the executor."""
    flags = list(stack.executor_flags)
    address = flags[flags.index("--metrics-listen") + 1]
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        text = response.read().decode()
    name = "moelora_executor_registry_outage_start_timestamp_seconds"
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name)]
    assert len(values) == 1, text
    return values[0]


def _upload_sql(stack: Stack) -> None:
    """sql:1 (the alpha adapter) and sql:2 (beta), sql@prod -> 1."""
    with stack.registry_client() as client:
        client.upload(stack.world.adapter_dir / "alpha", "sql", BASE)
        client.upload(stack.world.adapter_dir / "beta", "sql", BASE)
        client.set_alias("sql", "prod", 1)


def _forward(client: ExecutorClient, stack: Stack, ref: str | None) -> tuple[float, str]:
    return _timed(client, stack, ref)[:2]


def _timed(client: ExecutorClient, stack: Stack, ref: str | None) -> tuple[float, str, float]:
    """Seconds as the client saw them, the version used, seconds the executor reports."""
    layer = stack.world.moe_layers[0]
    start = time.perf_counter()
    result = client.forward(layer, stack.world.inputs[layer][:8], [(8, ref)])
    seconds = time.perf_counter() - start
    return seconds, result.resolved_adapters[0], result.server_time_us / 1e6


@dataclass(frozen=True)
class Phase:
    """Alias Forwards' p50 in one phase: as the client saw them, and inside the executor
    (where resolving happens; less of what else the shared machine runs)."""

    client: float
    executor: float

    def __str__(self) -> str:
        return f"{self.client * 1e3:.2f} ms ({self.executor * 1e3:.2f} ms in the executor)"


def _p50(client: ExecutorClient, stack: Stack, ref: str, expect: str) -> Phase:
    """The lowest p50 of ``BLOCKS`` blocks of ``CALLS`` calls: the same estimator for every
    phase, robust to what else runs on a shared 2-core machine for a moment."""
    seen, inside = [], []
    for _ in range(BLOCKS):
        times, executor = [], []
        for _ in range(CALLS):
            seconds, resolved, server = _timed(client, stack, ref)
            assert resolved == expect
            times.append(seconds)
            executor.append(server)
        seen.append(statistics.median(times))
        inside.append(statistics.median(executor))
    return Phase(min(seen), min(inside))


def _warnings(process: ServerProcess, event: str) -> int:
    return sum(1 for line in process.log().splitlines() if f'"{event}"' in line)


def test_alias_forwards_are_answered_through_a_registry_outage(
    stack: Stack, tmp_path: Path
) -> None:
    stack.start([])
    _upload_sql(stack)
    assert stack.executor is not None and stack.registry is not None
    with stack.executor_client() as client:
        _forward(client, stack, "sql@prod")  # loads sql:1
        layer = stack.world.moe_layers[0]
        out = client.forward(layer, stack.world.inputs[layer][:8], [(8, "sql@prod")]).output
        assert_close(out, stack.world.expected(layer, [(8, "alpha")]))
        before = _p50(client, stack, "sql@prod", "sql:1")

        stack.registry.terminate()
        wait_for(lambda: not client.get_executor_info().registry.reachable, timeout=30)
        time.sleep(float(STALENESS) * 1.5)  # every answer is past its staleness now
        during = _p50(client, stack, "sql@prod", "sql:1")

        info = client.get_executor_info().registry
        assert not info.reachable and not info.watching
        assert abs(info.unreachable_since.ToSeconds() - time.time()) < 60
        assert _outage_gauge(stack) == pytest.approx(info.unreachable_since.ToSeconds(), abs=1)
        # A reference never resolved fails at once, saying when to retry.
        start = time.perf_counter()
        with pytest.raises(Unavailable, match="retry in"):
            client.forward(layer, stack.world.inputs[layer][:8], [(8, "sql:2")])
        assert time.perf_counter() - start < 0.5

        # Another replica (same database) moves the alias while this one is down.
        other = Stack(stack.world, tmp_path / "other")
        other.tmp.mkdir()
        other.registry_address = f"127.0.0.1:{free_port()}"
        other.registry_flags = ("--data-dir", str(stack.data_dir), "--gc-interval-seconds", "0")
        other.start_registry()
        try:
            with other.registry_client() as registry:
                registry.set_alias("sql", "prod", 2)
        finally:
            other.stop()

        stack.start_registry()
        # Within the staleness (the next use asks again) or the watch's replay, whichever first.
        wait_for(lambda: _forward(client, stack, "sql@prod")[1] == "sql:2", timeout=30)
        after = _p50(client, stack, "sql@prod", "sql:2")
        assert client.get_executor_info().registry.reachable
        assert _outage_gauge(stack) == 0
    # Printed, not asserted (speed belongs to benchmarks; a shared 2-core machine moves these
    # by half): that requests do not wait on a registry known to be down is the probe pacing
    # of tests/unit/test_registry_outage.py, and the never-resolved reference above.
    print(f"\nalias Forward p50: before {before}, during the outage {during}, after {after}")
    assert _warnings(stack.executor, "registry_unreachable_serving_cached") == 1
    assert _warnings(stack.executor, "registry_reachable_again") == 1


def test_a_frozen_registry_costs_one_request_and_a_restart_serves_the_disk_cache(
    stack: Stack,
) -> None:
    stack.start([])
    _upload_sql(stack)
    assert stack.executor is not None and stack.registry is not None
    with stack.registry_client() as registry:
        digest = registry.get("sql:2").digest
    with stack.executor_client() as client:
        _forward(client, stack, "sql@prod")
        _forward(client, stack, "sql:2")
        os.kill(stack.registry.proc.pid, signal.SIGSTOP)  # accepts connections, answers nothing
        times = []
        for ref in ("sql:3", "sql@canary", "sql"):
            start = time.perf_counter()
            with pytest.raises(Unavailable):
                _forward(client, stack, ref)
            times.append(time.perf_counter() - start)
        # The first waits the resolve deadline (2 s), the next know the outage.
        assert times[0] < 3.5 and max(times[1:]) < 0.5, times
        time.sleep(float(STALENESS) * 1.5)
        assert _forward(client, stack, "sql:2")[1] == "sql:2"  # stale: served
    stack.kill(stack.registry)  # still stopped: the outage goes on
    stack.executor.terminate()
    stack.start_executor()
    with stack.executor_client() as client:
        # What the disk cache held, by version, digest and the alias it kept.
        assert _forward(client, stack, "sql:2")[1] == "sql:2"
        assert _forward(client, stack, "sql@prod")[1] == "sql:1"
        assert _forward(client, stack, f"sql@{digest}")[1] == "sql:2"
        with pytest.raises(Unavailable):
            _forward(client, stack, "sql")  # the bare name was never resolved


def test_an_executor_refused_the_watch_stops_serving_a_deleted_version(
    world: World, tmp_path: Path
) -> None:
    stack = Stack(
        world,
        tmp_path,
        executor_flags=("--registry-staleness-seconds", STALENESS),
        registry_flags=("--max-watch-streams", "2"),  # the least the registry takes
    )
    try:
        stack.start([], executor=False)
        _upload_sql(stack)
        # Holds both watch slots (with auth off every caller may use them all).
        with stack.registry_client() as client, client.watch(), client.watch():
            stack.start_executor()
            assert stack.executor is not None
            with ExecutorClient(stack.executor_address, retry=RetryPolicy(attempts=1)) as ex:
                assert _forward(ex, stack, "sql:1")[1] == "sql:1"
                assert not ex.get_executor_info().registry.watching
                client.delete("sql:1")
                # Asked again once stale: gone within the staleness, not served for ever.
                wait_for(lambda: _gone(ex, stack, "sql:1"), timeout=float(STALENESS) + 5)
            assert _warnings(stack.executor, "registry_watch_failed") >= 1
    finally:
        stack.stop()


def _gone(client: ExecutorClient, stack: Stack, ref: str) -> bool:
    try:
        _forward(client, stack, ref)
    except NotFound:
        return True
    return False
