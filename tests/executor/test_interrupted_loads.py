"""A load interrupted midway leaves nothing half-loaded, and the next load succeeds.

A real registry process serves a real adapter; a TCP proxy on 127.0.0.1 between it and the
executor's source cuts the connection (or stalls it) after a number of bytes. Downloads run
as two parallel ranged streams, packed as they arrive. Covered: a connection cut
mid-download, a process killed mid-download (the next process adopts nothing of it), bytes
damaged on disk after the check (hashed again, fetched again), a pack that fails halfway (the
host cache gets nothing), and a blob damaged in the registry, which only the check at the end
of a pipelined download can see (no host-cache entry, no slot, nothing on disk).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from prometheus_client import CollectorRegistry

from executor_service.app import ExecutorApp
from executor_service.client import ExecutorClient, RetryPolicy
from executor_service.config import ExecutorSettings
from executor_service.disk_cache import DiskCache
from executor_service.metrics import ExecutorMetrics
from executor_service.packer import pack_adapter
from executor_service.registry_source import RegistrySource
from executor_service.sources import AdapterFiles, ResolvedAdapter
from executor_service.synthetic import SyntheticBase, write_base_checkpoint
from shared.adapter_files import CONFIG_FILE, WEIGHTS_FILE
from shared.bench_servers import registry_server, write_adapter
from shared.errors import InvalidArgument, MoeLoraError
from shared.model_spec import ModelSpec
from shared.refs import AdapterRef
from shared.registry_client import RegistryClient
from tests.conftest import wait_for

BASE = "tiny"
STREAMS = 2


class CuttingProxy:
    """Forwards 127.0.0.1 TCP connections to ``target``; once ``limit`` more bytes came from
    the server (counted from when it is set) it cuts the connection (``stall``: stops
    forwarding and holds it open)."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self.limit: int | None = None
        self.stall = False
        self.forwarded = threading.Event()  # set once a connection reached its limit
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._sockets: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self._target)
            self._sockets += [client, server]
            threading.Thread(target=self._pipe, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, True), daemon=True).start()

    def _pipe(self, source: socket.socket, dest: socket.socket, metered: bool) -> None:
        try:
            while data := source.recv(65536):
                limit = self.limit if metered else None
                if limit is not None and len(data) > limit:
                    dest.sendall(data[:limit])
                    self.limit = 0
                    self.forwarded.set()
                    if not self.stall:
                        source.close()
                        dest.close()
                    return
                if limit is not None:
                    self.limit = limit - len(data)
                dest.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        for sock in self._sockets:
            sock.close()


@dataclass
class Setup:
    registry: str
    spec: ModelSpec
    adapter: Path
    nbytes: int
    #: The registry's local blob store, by sha256.
    blobs: Path
    checkpoint: Path


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    tmp = tmp_path_factory.mktemp("interrupted")
    spec = write_base_checkpoint(tmp / "base", SyntheticBase("qwen3_moe"), dtype=torch.bfloat16)
    nbytes = write_adapter(tmp / "adapter", spec, rank=8)
    with registry_server(tmp, ["--max-rank", "8"]) as address:
        with RegistryClient(address) as registry:
            registry.register_base_model(spec.to_proto(BASE))
            registry.upload(tmp / "adapter", "a", BASE)
        yield Setup(
            address, spec, tmp / "adapter", nbytes, tmp / "data" / "blobs" / "sha256", tmp / "base"
        )


@pytest.fixture
def proxy(setup: Setup) -> Iterator[CuttingProxy]:
    proxy = CuttingProxy(setup.registry)
    yield proxy
    proxy.close()


def _leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


def _source(client: RegistryClient, address: str, disk: DiskCache) -> RegistrySource:
    return RegistrySource(client, address, disk, streams=STREAMS, nice=0)


def _fetched(source: RegistrySource, adapter: ResolvedAdapter) -> AdapterFiles:
    """Downloads the adapter whole (checked, kept on disk), as a load does around its pack."""
    files = source.fetch(adapter)
    try:
        files.finish()
    finally:
        files.close()
    return source.fetch(adapter)  # from the disk cache now


def test_a_cut_connection_leaves_no_entry_and_the_next_load_succeeds(
    setup: Setup, proxy: CuttingProxy, tmp_path: Path
) -> None:
    disk = DiskCache(tmp_path / "disk", budget_bytes=10**9)
    with RegistryClient(proxy.address, timeout=10, connections=STREAMS) as client:
        source = _source(client, proxy.address, disk)
        adapter = source.resolve(AdapterRef.parse("a:1"))
        proxy.limit = setup.nbytes // 2
        with pytest.raises(MoeLoraError):
            _fetched(source, adapter)
        assert proxy.forwarded.is_set()
        assert disk.entries() == [] and _leftovers(tmp_path / "disk") == []
        proxy.limit = None
        files = _fetched(source, adapter)
    assert isinstance(files.weights, Path)
    assert files.weights.read_bytes() == (setup.adapter / WEIGHTS_FILE).read_bytes()
    assert [e.adapter for e in disk.entries()] == [adapter]


_CHILD = """
import sys
from pathlib import Path
from executor_service.app import ExecutorApp
from executor_service.client import ExecutorClient, RetryPolicy
from executor_service.config import ExecutorSettings
from executor_service.disk_cache import DiskCache
from executor_service.metrics import ExecutorMetrics
from executor_service.registry_source import RegistrySource
from executor_service.sources import AdapterFiles, ResolvedAdapter
from shared.refs import AdapterRef
from shared.registry_client import RegistryClient
address, root = sys.argv[1], Path(sys.argv[2])
with RegistryClient(address, timeout=60, connections=2) as client:
    source = RegistrySource(client, address, DiskCache(root, 10**9), streams=2, nice=0)
    source.fetch(source.resolve(AdapterRef.parse("a:1"))).finish()
"""


def test_a_process_killed_mid_download_leaves_nothing_the_next_one_adopts(
    setup: Setup, proxy: CuttingProxy, tmp_path: Path
) -> None:
    root = tmp_path / "disk"
    proxy.limit, proxy.stall = setup.nbytes // 2, True
    child = subprocess.Popen([sys.executable, "-c", _CHILD, proxy.address, str(root)])
    try:
        wait_for(proxy.forwarded.is_set, timeout=60)
        wait_for(lambda: any(p.name.startswith(".partial-") for p in root.iterdir()))
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    restarted = DiskCache(root, budget_bytes=10**9)
    assert restarted.entries() == [] and _leftovers(root) == []
    proxy.limit, proxy.stall = None, False
    with RegistryClient(proxy.address, timeout=10, connections=STREAMS) as client:
        source = _source(client, proxy.address, restarted)
        adapter = source.resolve(AdapterRef.parse("a:1"))
        assert isinstance(_fetched(source, adapter).weights, Path)
    assert [e.adapter for e in restarted.entries()] == [adapter]


def test_bytes_damaged_on_disk_are_hashed_again_and_fetched_again(
    setup: Setup, tmp_path: Path
) -> None:
    root = tmp_path / "disk"
    with RegistryClient(setup.registry, timeout=10, connections=STREAMS) as client:
        source = _source(client, setup.registry, DiskCache(root, 10**9))
        adapter = source.resolve(AdapterRef.parse("a:1"))
        weights = _fetched(source, adapter).weights
        assert isinstance(weights, Path)
        damaged = bytearray(weights.read_bytes())
        damaged[-1] ^= 0xFF
        weights.write_bytes(bytes(damaged))  # same size; a restart forgets the stamps
        again = _source(client, setup.registry, DiskCache(root, 10**9))
        files = _fetched(again, adapter)
    assert isinstance(files.weights, Path)
    assert files.weights.read_bytes() == (setup.adapter / WEIGHTS_FILE).read_bytes()


def test_a_pack_that_fails_halfway_returns_nothing(setup: Setup, tmp_path: Path) -> None:
    """The host cache only ever receives what pack_adapter returns: a NaN in the last tensor
    fails the whole pack, after the earlier layers were packed."""
    raw = bytearray((setup.adapter / WEIGHTS_FILE).read_bytes())
    raw[-2:] = b"\xc0\x7f"  # a bf16 NaN, the last element of the last tensor
    weights = tmp_path / WEIGHTS_FILE
    weights.write_bytes(bytes(raw))
    config = json.loads((setup.adapter / CONFIG_FILE).read_text())
    with pytest.raises(InvalidArgument, match="contains NaN or Inf"):
        pack_adapter(config, weights, setup.spec, 8, torch.float32)


def test_a_blob_damaged_in_the_registry_fails_at_the_end_and_leaves_nothing(
    setup: Setup, tmp_path: Path
) -> None:
    """Ranged reads are not checked by the registry, and the bytes are packed as they arrive:
    only the check at the end of the download sees the damage. The load fails DATA_LOSS and
    leaves no host-cache entry, no slot (every enabled flag still 0) and nothing on disk; with
    the blob repaired, the next load packs exactly what the genuine file packs to."""
    folder = tmp_path / "b"
    write_adapter(folder, setup.spec, rank=8, seed=3)
    with RegistryClient(setup.registry) as registry:
        version = registry.upload(folder, "b", BASE)
    weights = next(f for f in version.files if f.path == WEIGHTS_FILE)
    blob = setup.blobs / weights.sha256
    genuine = blob.read_bytes()
    damaged = bytearray(genuine)
    damaged[-2] ^= 0x01  # the lowest mantissa bit of the last bf16 value: still finite
    blob.chmod(0o644)
    blob.write_bytes(bytes(damaged))
    settings = ExecutorSettings.model_validate(
        {
            "listen": "127.0.0.1:0",
            "base_model_path": setup.checkpoint,
            "base_model_name": BASE,
            "registry_address": setup.registry,
            "disk_cache_dir": tmp_path / "disk",
            "download_streams": STREAMS,
            "num_slots": 2,
            "max_rank": 8,
            "metrics_listen": "",
            "kernel_autotune_seconds": 0.0,
        }
    )
    app = ExecutorApp(settings, ExecutorMetrics(CollectorRegistry()))
    app.start()
    try:
        assert app.loaded.wait(60) and app.load_error is None, app.load_error
        runtime = app.runtime
        assert runtime is not None
        with ExecutorClient(app.address, timeout=30, retry=RetryPolicy(attempts=1)) as client:
            with pytest.raises(MoeLoraError) as info:
                client.load_adapter("b:1", to_gpu=True)
            assert info.value.code == grpc.StatusCode.DATA_LOSS, info.value
            assert weights.sha256 in info.value.message
            manager = runtime.adapters
            assert manager.host.entries() == [] and manager.slots.adapters() == []
            assert all(
                not manager.lora_slots(layer).enabled.any() for layer in runtime.model.layers
            )
            assert _leftovers(tmp_path / "disk") == []

            blob.write_bytes(genuine)
            loaded = client.load_adapter("b:1", to_gpu=True)
            assert loaded.slot >= 0
        config = json.loads((folder / CONFIG_FILE).read_text())
        expected = pack_adapter(config, folder / WEIGHTS_FILE, setup.spec, 8, torch.float32)
        (entry,) = manager.host.entries()
        for index, layer in expected.layers.items():
            got = entry.packed.layers[index]
            for name in ("a13", "b13", "a2", "b2"):
                assert torch.equal(getattr(got, name), getattr(layer, name)), (index, name)
    finally:
        blob.write_bytes(genuine)
        app.drain()
