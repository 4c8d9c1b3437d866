"""Servers killed with SIGKILL in the middle of work, damaged and full disk caches. Each
scenario ends with nothing partial visible, data intact (sha256, and Forward outputs equal
to transformers + PEFT) and recovery without an operator: restart on the same data, and
everything after works."""

from __future__ import annotations

import contextlib
import hashlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from moelora.client.errors import MoeLoraError
from moelora.v1 import registry_pb2, registry_pb2_grpc
from tests.chaos.conftest import mounted_tmpfs
from tests.chaos.fault_proxy import FaultProxy
from tests.executor.conftest import assert_close
from tests.executor.worlds import Recipe, World, build_world
from tests.live_stack import BASE, Stack

pytestmark = pytest.mark.timeout(300)

FILES = ("adapter_config.json", "adapter_model.safetensors")


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    recipes = [Recipe("alpha", "both", 1), Recipe("beta", "down_only", 2)]
    return build_world("qwen3_moe", tmp_path_factory.mktemp("chaos_world"), recipes)


@pytest.fixture
def stack(world: World, tmp_path: Path) -> Iterator[Stack]:
    stack = Stack(world, tmp_path, registry_flags=("--gc-interval-seconds", "0"))
    try:
        yield stack
    finally:
        stack.stop()


def _sha256(folder: Path) -> dict[str, str]:
    return {n: hashlib.sha256((folder / n).read_bytes()).hexdigest() for n in FILES}


def _forward_matches(stack: Stack, adapter: str) -> None:
    layer = stack.world.moe_layers[0]
    segments: list[tuple[int, str | None]] = [(5, adapter), (3, None)]
    with stack.executor_client(attempts=4) as client:
        result = client.forward(layer, stack.world.inputs[layer][:8], segments)
    assert_close(result.output, stack.world.expected(layer, segments))


def test_registry_killed_mid_upload_and_mid_download(stack: Stack, tmp_path: Path) -> None:
    stack.start(["alpha"])
    folder = stack.world.adapter_dir / "beta"
    data = [(folder / n).read_bytes() for n in FILES]
    header = registry_pb2.UploadHeader(
        name="beta",
        base_model=BASE,
        files=[
            registry_pb2.AdapterFile(path=n, size_bytes=len(d))
            for n, d in zip(FILES, data, strict=True)
        ],
    )
    half_sent = threading.Event()

    def upload() -> Iterator[registry_pb2.UploadAdapterRequest]:
        yield registry_pb2.UploadAdapterRequest(header=header)
        yield registry_pb2.UploadAdapterRequest(
            chunk=registry_pb2.FileChunk(file_index=0, data=data[0])
        )
        half = data[1][: len(data[1]) // 2]
        yield registry_pb2.UploadAdapterRequest(
            chunk=registry_pb2.FileChunk(file_index=1, data=half)
        )
        half_sent.set()
        time.sleep(30)  # the registry dies meanwhile

    with grpc.insecure_channel(stack.registry_address) as channel:
        stub = registry_pb2_grpc.AdapterRegistryStub(channel)
        call = stub.UploadAdapter.future(upload(), timeout=60)
        assert half_sent.wait(30)
        time.sleep(0.3)  # let the registry spool what it got
        stack.kill(stack.registry)
        with pytest.raises(grpc.RpcError) as info:
            call.result()
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE

    stack.start_registry()  # same data folder, no operator
    with stack.registry_client() as client:
        assert [v.name for v in client.list_versions()] == ["alpha"]  # nothing half-visible
        time.sleep(1.5)
        client.gc(grace_seconds=1)  # what the crash left (spool, PENDING row) goes (0: default)
        spool = stack.data_dir / "spool"
        assert not spool.exists() or list(spool.iterdir()) == []
        client.upload(folder, "beta", BASE)
        client.download("beta:1", tmp_path / "beta")
        assert _sha256(tmp_path / "beta") == _sha256(folder)

    # Mid-download: the registry killed once the stream began (its version message came);
    # the client's download then fails, or completed from what was already sent.
    out = tmp_path / "cut"
    with stack.registry_client() as client:
        stream = client._stub.DownloadAdapter(registry_pb2.DownloadAdapterRequest(ref="beta:1"))
        next(stream)
        stack.kill(stack.registry)
        with contextlib.suppress(grpc.RpcError):
            for _ in stream:
                pass
        with pytest.raises(MoeLoraError) as failed:
            client.download("beta:1", out)
        assert failed.value.code == grpc.StatusCode.UNAVAILABLE
        assert not out.exists() or list(out.iterdir()) == []
    stack.start_registry()
    with stack.registry_client() as client:
        client.download("beta:1", tmp_path / "again")
    assert _sha256(tmp_path / "again") == _sha256(folder)


def test_executor_killed_mid_load_restarts_on_its_disk_cache(stack: Stack, world: World) -> None:
    stack.start(["alpha", "beta"], executor=False)
    # The executor reaches the registry through a slow link: a load takes seconds.
    with FaultProxy(stack.registry_address) as proxy:
        proxy.mode, proxy.delay, proxy.chunk = "slow", 0.2, 2048
        direct = stack.registry_address
        stack.registry_address = proxy.address
        stack.start_executor()
        with stack.executor_client() as executor:
            executor.load_adapter("beta")  # in the disk cache before the crash

            def load() -> None:
                with contextlib.suppress(MoeLoraError):
                    executor.load_adapter("alpha")

            loading = threading.Thread(target=load, daemon=True)
            loading.start()
            time.sleep(0.5)
            stack.kill(stack.executor)
            loading.join(30)
        entries = [p for p in stack.cache_dir.iterdir() if p.is_dir()]
        partials = [p for p in entries if p.name.startswith(".partial-")]
        assert len(entries) - len(partials) == 1  # beta only
        stack.registry_address = direct
    stack.start_executor()  # same disk cache; the registry link is fast again
    assert not [p for p in stack.cache_dir.iterdir() if p.name.startswith(".partial-")]
    _forward_matches(stack, "alpha")
    _forward_matches(stack, "beta")


def test_damaged_disk_cache_entries_are_fetched_again(stack: Stack) -> None:
    stack.start(["alpha", "beta"])
    _forward_matches(stack, "alpha")
    _forward_matches(stack, "beta")
    stack.kill(stack.executor)
    entries = sorted(p for p in stack.cache_dir.iterdir() if p.is_dir())
    assert len(entries) == 2
    weights = entries[0] / "adapter_model.safetensors"
    damaged = bytearray(weights.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF  # one flipped bit-pattern in the data
    weights.write_bytes(bytes(damaged))
    truncated = entries[1] / "adapter_model.safetensors"
    truncated.write_bytes(truncated.read_bytes()[:100])
    stack.start_executor()
    _forward_matches(stack, "alpha")
    _forward_matches(stack, "beta")
    assert stack.executor is not None
    assert stack.executor.log().count('"disk_cache_entry_damaged"') == 2  # both found, refetched


@pytest.fixture
def tiny_volume(tmp_path: Path, world: World) -> Iterator[Path]:
    """A tmpfs with room for one adapter and a half. Skips where mounting is not allowed."""
    size = sum((world.adapter_dir / "alpha" / n).stat().st_size for n in FILES)
    with mounted_tmpfs(tmp_path / "volume", (size * 3 // 2) // 1024 + 8) as mount:
        yield mount


def test_full_disk_cache_volume(stack: Stack, tiny_volume: Path) -> None:
    size = sum((stack.world.adapter_dir / "alpha" / n).stat().st_size for n in FILES)
    cache = tiny_volume / "cache"
    # The byte budget thinks there is room for ten; the volume has room for one.
    stack.executor_flags = ("--disk-cache-bytes", str(10 * size), "--disk-cache-dir", str(cache))
    stack.start(["alpha", "beta"])
    for _ in range(3):  # each load finds the volume full of the other: it sheds and goes on
        _forward_matches(stack, "alpha")
        with stack.executor_client() as client:
            client.unload_adapter("alpha")
        _forward_matches(stack, "beta")
        with stack.executor_client() as client:
            client.unload_adapter("beta")
    assert stack.executor is not None
    assert "disk_cache_shed" in stack.executor.log()
    assert not [p for p in cache.iterdir() if p.name.startswith(".partial-")]
