"""``--prefetch-on-watch``: an alias set on a new version brings it into the host cache before
any request asks for it; without the flag nothing is fetched.

A real registry process; an in-process executor that pulls from it. The alias event's sequence
is read from a watch stream of the test's own, and the executor's watcher reports when it has
handled that far, so "nothing was fetched" is checked after the event, not after a sleep.
The bounded queue and close are checked on a prefetcher over a gated local source.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from prometheus_client import CollectorRegistry

from executor_service.app import ExecutorApp
from executor_service.metrics import ExecutorMetrics
from executor_service.prefetch import QUEUE_PER_WORKER, Prefetcher
from executor_service.runtime import ExecutorRuntime
from executor_service.sources import LocalFolderSource
from moelora.client.registry import RegistryClient
from moelora.v1 import registry_pb2
from shared.refs import AdapterRef
from tests.conftest import wait_for
from tests.executor.conftest import BASE, GatedSource, RegistrySetup, running_executor
from tests.executor.worlds import World


@dataclass
class Executor:
    app: ExecutorApp
    runtime: ExecutorRuntime
    metrics: CollectorRegistry

    def prefetches(self, result: str) -> float:
        value = self.metrics.get_sample_value(
            "moelora_executor_prefetches_total", {"result": result}
        )
        return 0.0 if value is None else value


@pytest.fixture
def executor(registry_setup: RegistrySetup, request: pytest.FixtureRequest) -> Iterator[Executor]:
    with running_executor(registry_setup, prefetch_on_watch=request.param) as running:
        runtime = running.app.runtime
        assert runtime is not None and runtime.watcher is not None
        assert runtime.watcher.connected.wait(30)
        yield Executor(running.app, runtime, running.registry)


def _alias_new_version(
    registry_setup: RegistrySetup, name: str
) -> registry_pb2.WatchAdaptersResponse:
    """Uploads the adapter as ``name`` and points ``prod`` at it; the ALIAS_SET event."""
    with RegistryClient(registry_setup.registry) as registry, registry.watch(name=name) as stream:
        version = registry.upload(registry_setup.adapter, name, BASE)
        registry.set_alias(name, "prod", version.version)
        for event in stream:
            if event.type == registry_pb2.AdapterEventType.ADAPTER_EVENT_TYPE_ALIAS_SET:
                return event
    raise AssertionError("the watch stream ended before the alias event")


@pytest.mark.parametrize("executor", [True], indirect=True)
def test_an_aliased_version_reaches_the_host_cache_without_a_request(
    registry_setup: RegistrySetup, executor: Executor
) -> None:
    event = _alias_new_version(registry_setup, "promoted")
    manager = executor.runtime.adapters
    wait_for(lambda: manager.host.peek(event.digest) is not None, timeout=60)
    entry = manager.host.peek(event.digest)
    assert entry is not None and entry.adapter.label == f"promoted:{event.version}"
    assert entry.packed.rank == 8
    # Packed in host memory only: no slot was taken for a guess.
    assert not manager.slots.holds(event.digest) and manager.slots.adapters() == []
    wait_for(lambda: executor.prefetches("loaded") == 1)
    assert executor.prefetches("failed") == executor.prefetches("dropped") == 0


@pytest.mark.parametrize("executor", [False], indirect=True)
def test_without_the_flag_nothing_is_fetched(
    registry_setup: RegistrySetup, executor: Executor
) -> None:
    event = _alias_new_version(registry_setup, "ignored")
    watcher = executor.runtime.watcher
    assert watcher is not None and executor.runtime.prefetcher is None
    wait_for(lambda: watcher.last_sequence >= event.sequence, timeout=30)
    manager = executor.runtime.adapters
    assert manager.host.entries() == []
    assert manager.list_loaded() == []  # not even in the disk cache
    assert executor.prefetches("loaded") == 0


def _alias_event(name: str, digest: str) -> registry_pb2.WatchAdaptersResponse:
    return registry_pb2.WatchAdaptersResponse(
        type=registry_pb2.AdapterEventType.ADAPTER_EVENT_TYPE_ALIAS_SET,
        name=name,
        digest=digest,
        alias="prod",
    )


def test_a_full_queue_drops_the_oldest_and_close_lets_the_load_in_progress_finish(
    qwen_world: World,
) -> None:
    """One worker held inside a fetch; the queue (8) overflows by 2; close drops what waits."""
    gate = threading.Event()
    source = GatedSource(LocalFolderSource(qwen_world.adapter_dir), gate)
    with running_executor(qwen_world, source=source) as running:
        runtime = running.app.runtime
        assert runtime is not None
        manager = runtime.adapters
        alpha = manager.resolve(AdapterRef.parse("alpha"))
        metrics = CollectorRegistry()
        prefetcher = Prefetcher(
            manager, ExecutorMetrics(metrics), max_inflight=1, watch=runtime.device
        )
        prefetcher.start()
        try:

            def count(result: str) -> float:
                value = metrics.get_sample_value(
                    "moelora_executor_prefetches_total", {"result": result}
                )
                return 0.0 if value is None else value

            prefetcher.offer(_alias_event("alpha", alpha.digest))
            wait_for(lambda: source.fetches.get(alpha.label) == 1)
            for i in range(QUEUE_PER_WORKER + 2):
                prefetcher.offer(_alias_event(f"x{i}", "sha256:" + f"{i:064x}"))
            assert count("dropped") == 2
        finally:
            gate.set()
            prefetcher.close()
        assert manager.host.peek(alpha.digest) is not None
        assert count("loaded") == 1 and count("failed") == 0  # the queued ones never ran
        assert source.fetches == {alpha.label: 1}
