"""A load interrupted midway leaves nothing half-loaded, and the next load succeeds.

A real registry process serves a real adapter; TCP proxies on 127.0.0.1 between it and the
executor's source (one before its gRPC port, one before its blob HTTP server, whose signed URLs
name the proxy) cut a connection (or stall it) after a number of bytes. Downloads run as two
parallel ranged reads, over the signed URLs (the executor's path with a local blob store) or
the DownloadAdapter stream (a registry without URLs), packed as they arrive. Covered: a
connection cut mid-download on either path, a process killed mid-download (the next process
adopts nothing of it), bytes damaged on disk after the check (hashed again, fetched again), a
pack that fails halfway (the host cache gets nothing), and a blob damaged in the registry,
which only the check of the bytes after they were packed can see (no host-cache entry, no slot,
nothing on disk): at the end of the file hashed whole, or of the piece when the registry
recorded pieces, which the disk cache then keeps for its check after a restart.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch
from prometheus_client import CollectorRegistry

from executor_service.app import ExecutorApp
from executor_service.config import ExecutorSettings
from executor_service.disk_cache import DiskCache
from executor_service.metrics import ExecutorMetrics
from executor_service.packer import pack_adapter
from executor_service.registry_source import RegistrySource, RegistryWatcher
from executor_service.sources import AdapterFiles, ResolvedAdapter
from executor_service.synthetic import SyntheticBase, write_base_checkpoint
from moelora.client.adapter_files import CONFIG_FILE, WEIGHTS_FILE
from moelora.client.errors import FailedPrecondition, InvalidArgument, MoeLoraError
from moelora.client.executor import ExecutorClient, RetryPolicy
from moelora.client.model_spec import ModelSpec
from moelora.client.registry import RegistryClient
from moelora.v1 import registry_pb2
from shared.bench_servers import registry_server, write_adapter
from shared.ports import free_port
from shared.refs import AdapterRef
from shared.url_ranges import UrlRangeReader
from tests.conftest import wait_for
from tests.proxy import CuttingProxy
from tests.registry.conftest import registry_settings, serve_registry

BASE = "tiny"
STREAMS = 2
MIB = 1 << 20


class StreamOnlyClient(RegistryClient):
    """A registry client as one of a registry without blob URLs sees it: GetDownloadUrls
    answers FAILED_PRECONDITION, so the source takes the DownloadAdapter stream."""

    def download_urls(
        self, ref: str, expires_in_seconds: int = 0
    ) -> registry_pb2.GetDownloadUrlsResponse:
        raise FailedPrecondition("no blob URLs here")


@dataclass
class Setup:
    registry: str
    spec: ModelSpec
    adapter: Path
    nbytes: int
    #: The registry's local blob store, by sha256.
    blobs: Path
    checkpoint: Path
    #: Before the registry's blob HTTP server: the signed URLs name it.
    http_proxy: CuttingProxy


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    tmp = tmp_path_factory.mktemp("interrupted")
    spec = write_base_checkpoint(tmp / "base", SyntheticBase("qwen3_moe"), dtype=torch.bfloat16)
    nbytes = write_adapter(tmp / "adapter", spec, rank=8)
    http = f"127.0.0.1:{free_port()}"
    http_proxy = CuttingProxy(http)
    # Pieces of 1 MiB (the smallest): a rank-256 adapter has two.
    flags = ["--max-rank", "256", "--part-size-bytes", str(MIB), "--http-listen", http]
    flags.append("--http-public-url")
    try:
        with registry_server(tmp, [*flags, f"http://{http_proxy.address}"]) as address:
            with RegistryClient(address) as registry:
                registry.register_base_model(spec.to_proto(BASE))
                registry.upload(tmp / "adapter", "a", BASE)
            blobs = tmp / "data" / "blobs" / "sha256"
            yield Setup(address, spec, tmp / "adapter", nbytes, blobs, tmp / "base", http_proxy)
    finally:
        http_proxy.close()


@pytest.fixture
def proxy(setup: Setup) -> Iterator[CuttingProxy]:
    """Before the registry's gRPC port; the blob HTTP proxy is reset for each test too."""
    setup.http_proxy.reset()
    proxy = CuttingProxy(setup.registry)
    yield proxy
    proxy.close()
    setup.http_proxy.reset()


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


@pytest.mark.parametrize("how", ["cut", "silent"])
@pytest.mark.parametrize("path", ["urls", "stream"])
def test_a_broken_connection_fails_the_load_in_seconds_and_the_next_load_succeeds(
    setup: Setup, proxy: CuttingProxy, tmp_path: Path, path: str, how: str
) -> None:
    """A connection cut mid-download, or one that dies without a word (``silent``: the proxy
    holds it open and forwards nothing, as a partition or a powered-off node does), fails the
    download, leaving nothing behind, instead of holding it: on the stream, a silent one is
    found by gRPC keepalive (1 s here), though the call itself has a minute; over the URLs, by
    the socket's timeout (2 s here)."""
    disk = DiskCache(tmp_path / "disk", budget_bytes=10**9)
    client_type = RegistryClient if path == "urls" else StreamOnlyClient
    broken = setup.http_proxy if path == "urls" else proxy  # where the bytes flow
    with client_type(proxy.address, timeout=60, connections=STREAMS, keepalive_seconds=1) as client:
        source = RegistrySource(
            client, proxy.address, disk, STREAMS, nice=0, urls=UrlRangeReader(timeout=2)
        )
        adapter = source.resolve(AdapterRef.parse("a:1"))
        broken.limit, broken.stall = setup.nbytes // 2, how == "silent"
        started = time.monotonic()
        with pytest.raises(MoeLoraError) as info:
            _fetched(source, adapter)
        assert time.monotonic() - started < 20, "noticed by keepalive, not the call deadline"
        assert info.value.code == grpc.StatusCode.UNAVAILABLE, info.value
        assert broken.forwarded.is_set()
        assert disk.entries() == [] and _leftovers(tmp_path / "disk") == []
        setup.http_proxy.reset()
        proxy.reset()
        files = _fetched(source, adapter)
    assert isinstance(files.weights, Path)
    assert files.weights.read_bytes() == (setup.adapter / WEIGHTS_FILE).read_bytes()
    assert [e.adapter for e in disk.entries()] == [adapter]
    # The bytes took the path asked for; gRPC carried only the calls around them on the other.
    other = proxy if path == "urls" else setup.http_proxy
    assert broken.bytes_from_server >= setup.nbytes
    assert other.bytes_from_server < setup.nbytes // 10


def test_a_watch_gone_silent_is_noticed_and_reconnected(
    setup: Setup, proxy: CuttingProxy, tmp_path: Path
) -> None:
    """A quiet watch stream over a connection that died without a word: keepalive (1 s here)
    finds it, so the source stops trusting moving references (aliases, bare names: the watcher
    clears ``connected`` and the source's watching flag together) instead of serving them
    stale forever, and the watcher reconnects once the network is back."""
    disk = DiskCache(tmp_path / "disk", budget_bytes=10**9)
    with RegistryClient(proxy.address, timeout=60, keepalive_seconds=1) as client:
        source = _source(client, proxy.address, disk)
        watcher = RegistryWatcher(client, source, on_deleted=lambda digest: None)
        watcher.start()
        try:
            assert watcher.connected.wait(30)
            proxy.limit, proxy.stall = 0, True  # the next bytes from the registry: a ping's ack
            wait_for(lambda: not watcher.connected.is_set(), timeout=15)
            proxy.reset()
            assert watcher.connected.wait(30)
        finally:
            watcher.close()


def test_urls_nobody_answers_fall_back_to_the_stream(
    setup: Setup, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A registry whose blob URLs name a host the executor cannot connect to (a wrong
    --http-public-url) makes downloads slower, not impossible: parts go over the stream."""
    nobody = f"http://127.0.0.1:{free_port()}"
    registry = serve_registry(registry_settings(tmp_path, http_public_url=nobody, max_rank=8))
    try:
        with RegistryClient(registry.address, timeout=10, connections=STREAMS) as client:
            client.register_base_model(setup.spec.to_proto(BASE))
            client.upload(setup.adapter, "a", BASE)
            assert client.download_urls("a:1").files[0].url.startswith(nobody)
            disk = DiskCache(tmp_path / "disk", 10**9)
            source = _source(client, registry.address, disk)
            adapter = source.resolve(AdapterRef.parse("a:1"))
            with caplog.at_level(logging.WARNING, logger="executor_service.registry_source"):
                files = _fetched(source, adapter)
            assert isinstance(files.weights, Path)
            assert files.weights.read_bytes() == (setup.adapter / WEIGHTS_FILE).read_bytes()
            assert "blob_urls_unreachable" in caplog.messages
            # URLs rest for a while: the next download does not try them again.
            disk.remove(adapter.digest)
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="executor_service.registry_source"):
                assert isinstance(_fetched(source, adapter).weights, Path)
            assert "blob_urls_unreachable" not in caplog.messages
    finally:
        registry.server.drain()
        registry.app.close()


_CHILD = """
import sys
from pathlib import Path
from executor_service.app import ExecutorApp
from moelora.client.executor import ExecutorClient, RetryPolicy
from executor_service.config import ExecutorSettings
from executor_service.disk_cache import DiskCache
from executor_service.metrics import ExecutorMetrics
from executor_service.registry_source import RegistrySource, RegistryWatcher
from executor_service.sources import AdapterFiles, ResolvedAdapter
from shared.refs import AdapterRef
from moelora.client.registry import RegistryClient
from shared.url_ranges import UrlRangeReader
address, root = sys.argv[1], Path(sys.argv[2])
with RegistryClient(address, timeout=60, connections=2) as client:
    source = RegistrySource(client, address, DiskCache(root, 10**9), streams=2, nice=0)
    source.fetch(source.resolve(AdapterRef.parse("a:1"))).finish()
"""


def test_a_process_killed_mid_download_leaves_nothing_the_next_one_adopts(
    setup: Setup, proxy: CuttingProxy, tmp_path: Path
) -> None:
    root = tmp_path / "disk"
    stalled = setup.http_proxy  # the bytes come over the signed URLs
    stalled.limit, stalled.stall = setup.nbytes // 2, True
    child = subprocess.Popen([sys.executable, "-c", _CHILD, proxy.address, str(root)])
    try:
        wait_for(stalled.forwarded.is_set, timeout=60)
        wait_for(lambda: any(p.name.startswith(".partial-") for p in root.iterdir()))
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    restarted = DiskCache(root, budget_bytes=10**9)
    assert restarted.entries() == [] and _leftovers(root) == []
    stalled.reset()
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


def test_a_damaged_piece_is_named_and_a_whole_download_keeps_the_registrys_pieces(
    setup: Setup, tmp_path: Path
) -> None:
    """With the registry's pieces (1 MiB here) the check names the damaged piece; a genuine
    download keeps the registry's listing with the disk-cache entry, which a restarted
    executor checks by pieces."""
    folder = tmp_path / "c"
    write_adapter(folder, setup.spec, rank=256, seed=5)
    with RegistryClient(setup.registry) as registry:
        version = registry.upload(folder, "c", BASE)
    weights = next(f for f in version.files if f.path == WEIGHTS_FILE)
    assert weights.part_size_bytes == MIB and len(weights.part_sha256) == 2
    blob = setup.blobs / weights.sha256
    genuine = blob.read_bytes()
    damaged = bytearray(genuine)
    damaged[MIB + 100] ^= 0x01
    blob.chmod(0o644)
    root = tmp_path / "disk"
    try:
        blob.write_bytes(bytes(damaged))
        with RegistryClient(setup.registry, timeout=10, connections=STREAMS) as client:
            source = _source(client, setup.registry, DiskCache(root, 10**9))
            adapter = source.resolve(AdapterRef.parse("c:1"))
            with pytest.raises(MoeLoraError, match=rf"bytes {MIB}-\d+ \(piece 2 of 2\)"):
                _fetched(source, adapter)
            assert _leftovers(root) == []
            blob.write_bytes(genuine)
            assert isinstance(_fetched(source, adapter).weights, Path)
    finally:
        blob.write_bytes(genuine)
    (entry,) = [p for p in root.iterdir()]
    kept = {row["path"]: row for row in json.loads((entry / "files.json").read_text())}
    assert kept[WEIGHTS_FILE]["part_sha256"] == list(weights.part_sha256)
    assert kept[WEIGHTS_FILE]["sha256"] == weights.sha256
    restarted = DiskCache(root, 10**9, check_threads=2)
    assert restarted.get(adapter.digest) == entry
