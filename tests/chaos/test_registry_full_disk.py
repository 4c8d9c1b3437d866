"""The registry's data volume fills up (SQLite, blobs and spool on a 2 MiB tmpfs): uploads
that do not fit are RESOURCE_EXHAUSTED and leave no blob or spool file behind, and deleting
versions and collecting garbage still work, after which uploads fit again."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from moelora.client.errors import MoeLoraError
from tests.chaos.conftest import mounted_tmpfs
from tests.executor.worlds import Recipe, World, build_world
from tests.live_stack import BASE, Stack

VOLUME_KIB = 2048


@pytest.fixture(scope="module")
def small_world(tmp_path_factory: pytest.TempPathFactory) -> World:
    return build_world("qwen3_moe", tmp_path_factory.mktemp("full") / "world", [Recipe("alpha")])


@pytest.fixture
def volume(tmp_path: Path) -> Iterator[Path]:
    with mounted_tmpfs(tmp_path / "volume", VOLUME_KIB) as mount:
        yield mount


def _variant(source: Path, target: Path, n: int) -> Path:
    """``source`` with its first weight's lowest byte changed: other bytes, another blob."""
    shutil.copytree(source, target)
    weights = target / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    start = 8 + int.from_bytes(data[:8], "little")
    data[start] = (data[start] + 1 + n) % 256
    weights.write_bytes(bytes(data))
    return target


def _files(folder: Path) -> set[str]:
    return {p.name for p in folder.rglob("*") if p.is_file()} if folder.exists() else set()


def test_a_full_volume_refuses_uploads_and_still_frees_space(
    small_world: World, volume: Path, tmp_path: Path, repeats: int
) -> None:
    data = volume / "registry"
    stack = Stack(small_world, tmp_path, registry_flags=("--data-dir", str(data)))
    try:
        stack.start(executor=False)
        for round_ in range(repeats):
            with stack.registry_client() as client:
                outcomes = []
                for i in range(60):
                    adapter = _variant(
                        small_world.adapter_dir / "alpha", tmp_path / f"v{round_}-{i}", i
                    )
                    try:
                        client.upload(adapter, f"a{i}", BASE)
                        outcomes.append("OK")
                    except MoeLoraError as exc:
                        outcomes.append(exc.code.name)
                        if exc.code is grpc.StatusCode.RESOURCE_EXHAUSTED:
                            assert "storage is full" in exc.message
                ready = [v for v in client.list_versions() if v.status == 2]  # READY
                print(f"\nfull volume: {outcomes.count('OK')} uploads fit, then "
                      f"{sorted(set(outcomes) - {'OK'})}")  # fmt: skip
                assert "OK" in outcomes and set(outcomes) == {"OK", "RESOURCE_EXHAUSTED"}
                # Nothing left behind by the refused uploads: the READY versions' blobs alone
                # (their configs are one blob).
                assert len(_files(data / "blobs")) == len(ready) + 1
                assert not _files(data / "spool")
                for version in client.list_versions():
                    client.delete(f"{version.name}:{version.version}")
                time.sleep(1.1)
                report = client.gc(grace_seconds=1)  # 0 would mean the default
                assert len(report.removed_blobs) == len(ready) + 1
                assert not list(client.list_versions())
                client.upload(small_world.adapter_dir / "alpha", "after", BASE)
                client.delete("after:1")
                time.sleep(1.1)
                client.gc(grace_seconds=1)
                assert ready
    finally:
        stack.stop()
