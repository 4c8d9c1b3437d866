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
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

from executor_service.app import ExecutorApp
from executor_service.config import ExecutorSettings
from executor_service.metrics import ExecutorMetrics
from executor_service.prefetch import QUEUE_PER_WORKER, Prefetcher
from executor_service.runtime import ExecutorRuntime
from executor_service.sources import LocalFolderSource
from executor_service.synthetic import SyntheticBase, write_base_checkpoint
from moelora.v1 import registry_pb2
from shared.bench_servers import registry_server, write_adapter
from shared.model_spec import ModelSpec
from shared.refs import AdapterRef
from shared.registry_client import RegistryClient
from tests.conftest import wait_for
from tests.executor.conftest import GatedSource, running_executor
from tests.executor.worlds import World

BASE = "tiny"


@dataclass
class Setup:
    registry: str
    spec: ModelSpec
    checkpoint: Path
    adapter: Path


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    tmp = tmp_path_factory.mktemp("prefetch")
    spec = write_base_checkpoint(tmp / "base", SyntheticBase("qwen3_moe"), dtype=torch.bfloat16)
    write_adapter(tmp / "adapter", spec, rank=8)
    with registry_server(tmp, ["--max-rank", "8"]) as address:
        with RegistryClient(address) as registry:
            registry.register_base_model(spec.to_proto(BASE))
        yield Setup(address, spec, tmp / "base", tmp / "adapter")


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
def executor(setup: Setup, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Executor]:
    values: dict[str, Any] = {
        "listen": "127.0.0.1:0",
        "base_model_path": setup.checkpoint,
        "base_model_name": BASE,
        "registry_address": setup.registry,
        "disk_cache_dir": tmp_path / "disk",
        "num_slots": 4,
        "max_rank": 8,
        "host_cache_bytes": 64 * 1024**2,
        "metrics_listen": "",
        "drain_seconds": 5.0,
        "log_format": "text",
        "kernel_autotune_seconds": 0.0,
        "prefetch_on_watch": request.param,
    }
    metrics = CollectorRegistry()
    app = ExecutorApp(ExecutorSettings(**values), ExecutorMetrics(metrics))
    app.start()
    try:
        assert app.loaded.wait(60) and app.load_error is None, app.load_error
        runtime = app.runtime
        assert runtime is not None and runtime.watcher is not None
        assert runtime.watcher.connected.wait(30)
        yield Executor(app, runtime, metrics)
    finally:
        app.drain()


def _alias_new_version(setup: Setup, name: str) -> registry_pb2.WatchAdaptersResponse:
    """Uploads the adapter as ``name`` and points ``prod`` at it; the ALIAS_SET event."""
    with RegistryClient(setup.registry) as registry, registry.watch(name=name) as stream:
        version = registry.upload(setup.adapter, name, BASE)
        registry.set_alias(name, "prod", version.version)
        for event in stream:
            if event.type == registry_pb2.AdapterEventType.ADAPTER_EVENT_TYPE_ALIAS_SET:
                return event
    raise AssertionError("the watch stream ended before the alias event")


@pytest.mark.parametrize("executor", [True], indirect=True)
def test_an_aliased_version_reaches_the_host_cache_without_a_request(
    setup: Setup, executor: Executor
) -> None:
    event = _alias_new_version(setup, "promoted")
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
def test_without_the_flag_nothing_is_fetched(setup: Setup, executor: Executor) -> None:
    event = _alias_new_version(setup, "ignored")
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
