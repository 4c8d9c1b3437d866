"""WatchAdapters: READY / DELETED / alias events in commit order, resumable by
sequence, filtered, OUT_OF_RANGE outside the kept history, delivered across
replicas that share a database, and ended with UNAVAILABLE on drain."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from moelora.client.errors import MoeLoraError
from moelora.client.registry import RegistryClient, WatchStream
from moelora.v1 import registry_pb2
from tests.registry.conftest import BASE, Served, register_base
from tests.registry.fixtures import write_adapter

E = registry_pb2.AdapterEventType


class Collector:
    """Reads a stream on a thread so the test can wait with a deadline."""

    def __init__(self, stream: WatchStream) -> None:
        self.stream = stream
        self.events: queue.Queue[registry_pb2.WatchAdaptersResponse | Exception] = queue.Queue()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        try:
            for event in self.stream:
                self.events.put(event)
        except Exception as exc:
            self.events.put(exc)

    def take(self, n: int, timeout: float = 10) -> list[registry_pb2.WatchAdaptersResponse]:
        out = []
        for _ in range(n):
            item = self.events.get(timeout=timeout)
            assert not isinstance(item, Exception), item
            out.append(item)
        return out

    def error(self, timeout: float = 10) -> Exception:
        item = self.events.get(timeout=timeout)
        assert isinstance(item, Exception), item
        return item


def _summary(events: list[registry_pb2.WatchAdaptersResponse]) -> list[tuple[str, int, str, int]]:
    return [
        (E.Name(e.type).removeprefix("ADAPTER_EVENT_TYPE_"), e.version, e.alias, e.previous_version)
        for e in events
    ]


@pytest.fixture
def served(database_url: str, serve: Callable[..., Served], base_model_dir: Path) -> Served:
    registry = serve(database_url=database_url)
    with registry.client() as client:
        register_base(client, base_model_dir)
    return registry


def test_events_in_order_resumable_and_filtered(served: Served, tmp_path: Path) -> None:
    client = served.client()
    a1, a2 = write_adapter(tmp_path / "a1", seed=1), write_adapter(tmp_path / "a2", seed=2)
    watch = client.watch()
    everything = Collector(watch)
    only_other = Collector(client.watch(name="other"))

    client.upload(a1, "sql", BASE)
    client.set_alias("sql", "prod", 1)
    client.upload(a2, "other", BASE)
    v2 = client.upload(a2, "sql", BASE, alias="prod")
    client.delete("sql:2")

    events = everything.take(7)
    assert _summary(events) == [
        ("READY", 1, "", 0),
        ("ALIAS_SET", 1, "prod", 0),
        ("READY", 1, "", 0),
        ("READY", 2, "", 0),
        ("ALIAS_SET", 2, "prod", 1),
        ("ALIAS_DELETED", 2, "prod", 0),
        ("DELETED", 2, "", 0),
    ]
    sequences = [e.sequence for e in events]
    assert sequences == list(range(watch.start_sequence + 1, watch.start_sequence + 8))
    assert events[3].digest == v2.digest and events[3].name == "sql"
    assert [(e.name, e.type) for e in only_other.take(1)] == [("other", E.ADAPTER_EVENT_TYPE_READY)]
    assert only_other.events.empty()

    # A client that saw up to the fourth event resumes without a gap.
    resumed = Collector(client.watch(after_sequence=sequences[3]))
    assert [e.sequence for e in resumed.take(3)] == sequences[4:]
    for stream in (everything, only_other, resumed):
        stream.stream.cancel()
    client.close()


def test_out_of_range(serve: Callable[..., Served], tmp_path: Path, base_model_dir: Path) -> None:
    served = serve(event_retention_seconds=0)
    with served.client() as client:
        register_base(client, base_model_dir)
        client.upload(write_adapter(tmp_path / "a"), "a", BASE)
        client.set_alias("a", "prod", 1)
        with pytest.raises(MoeLoraError) as info:
            client.watch(after_sequence=100)
        assert info.value.code == grpc.StatusCode.OUT_OF_RANGE
        assert "beyond the newest event 2" in info.value.message
        with client.watch(after_sequence=1) as stream:  # still kept
            assert stream.start_sequence == 1
        client.gc(dry_run=False)  # prunes events older than the retention (0 s)
        with pytest.raises(MoeLoraError) as info:
            client.watch(after_sequence=1)
        assert info.value.code == grpc.StatusCode.OUT_OF_RANGE
        assert "no longer kept" in info.value.message
        with pytest.raises(MoeLoraError) as info:
            client.watch(name="bad/name")
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_events_reach_watchers_on_other_replicas(
    database_url: str, serve: Callable[..., Served], tmp_path: Path, base_model_dir: Path
) -> None:
    """Two registries on one database: the watcher's replica learns of the
    other's commits by polling the database (watch_poll_seconds)."""
    blobs = f"file://{tmp_path / 'shared-blobs'}"
    watched = serve(database_url=database_url, blob_url=blobs, data_dir=tmp_path / "r1")
    writer = serve(database_url=database_url, blob_url=blobs, data_dir=tmp_path / "r2")
    with writer.client() as w, watched.client() as r:
        register_base(w, base_model_dir)
        stream = Collector(r.watch(name="x"))
        w.upload(write_adapter(tmp_path / "a"), "x", BASE, alias="live")
        assert _summary(stream.take(2)) == [("READY", 1, "", 0), ("ALIAS_SET", 1, "live", 0)]
        assert r.get("x@live").version == 1
        stream.stream.cancel()


def test_drain_ends_watch_with_unavailable(served: Served) -> None:
    client = RegistryClient(served.address)
    stream = Collector(client.watch())
    threading.Thread(target=served.server.drain, daemon=True).start()
    error = stream.error(timeout=10)
    assert isinstance(error, MoeLoraError) and error.code == grpc.StatusCode.UNAVAILABLE
    assert "after_sequence=0" in error.message
    client.close()
