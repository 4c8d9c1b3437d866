"""Concurrent uploads of one name get distinct, gap-free versions and one event
each, on SQLite and PostgreSQL (races on the adapter row, the version number and
the event counter all settled by the database)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from registry_service.domain import Chunk, DeclaredFile, UploadHeader
from tests.registry.conftest import BASE, Served, register_base
from tests.registry.fixtures import write_adapter

THREADS = 8
UPLOADS_PER_THREAD = 3


def test_concurrent_uploads_of_one_name(
    database_url: str, serve: Callable[..., Served], tmp_path: Path, base_model_dir: Path
) -> None:
    served = serve(database_url=database_url)
    registry = served.app.registry
    with served.client() as client:
        register_base(client, base_model_dir)
    adapters = [write_adapter(tmp_path / f"a{i}", seed=i) for i in range(THREADS)]
    start = registry.store.last_sequence()

    def upload(folder: Path) -> list[int]:
        files = [folder / "adapter_config.json", folder / "adapter_model.safetensors"]
        header = UploadHeader(
            name="shared",
            base_model=BASE,
            description="",
            labels={},
            alias=None,
            files=[DeclaredFile(f.name, f.stat().st_size, None) for f in files],
        )
        versions = []
        for _ in range(UPLOADS_PER_THREAD):
            chunks = [Chunk(i, 0, f.read_bytes()) for i, f in enumerate(files)]
            versions.append(registry.upload(header, chunks, "test").version)
        return versions

    with ThreadPoolExecutor(THREADS) as pool:
        results = list(pool.map(upload, adapters))
    versions = sorted(v for thread in results for v in thread)
    total = THREADS * UPLOADS_PER_THREAD
    assert versions == list(range(1, total + 1))
    with served.client() as client:
        listed = [v.version for v in client.list_versions(name="shared")]
    assert listed == list(range(total, 0, -1))
    events = registry.store.events(start, start + total + 5, "", "", 100)
    assert [e.sequence for e in events] == list(range(start + 1, start + total + 1))
    assert sorted(e.version for e in events) == versions
