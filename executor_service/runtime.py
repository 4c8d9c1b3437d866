"""Where the executor's parts are built from its settings: device, base model, slot buffers,
host cache, adapter source, adapter manager and engine, wired together explicitly."""

from __future__ import annotations

import functools
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass

import torch

import kernels
from executor_service.adapters import AdapterManager, PackSettings
from executor_service.batch import KernelFn
from executor_service.config import ExecutorSettings
from executor_service.device_fault import DeviceWatch
from executor_service.disk_cache import DiskCache
from executor_service.engine import EngineSettings, ForwardEngine
from executor_service.graphs import GraphCache, graph_buckets
from executor_service.host_cache import HostCache
from executor_service.host_pool import HostPool
from executor_service.kernel_configs import KernelConfigReport, prepare_kernel_configs
from executor_service.loader import (
    CONCURRENT_PACKS,
    Loader,
    default_threads,
    limit_torch_threads,
    load_threads,
)
from executor_service.metrics import ExecutorMetrics
from executor_service.model_loader import BaseModel, load_base_model
from executor_service.pack_warmup import warm_up_packing
from executor_service.prefetch import Prefetcher
from executor_service.registry_outage import RegistryOutage
from executor_service.registry_source import RegistrySource, RegistryWatcher
from executor_service.runner import Runner
from executor_service.scheduler import Scheduler, SchedulerSettings
from executor_service.slot_buffers import DeviceSync, SlotBuffers
from executor_service.slots import LRUPolicy, SlotManager
from executor_service.sources import AdapterSource, LocalFolderSource
from executor_service.staging import Staging
from kernels.forward import Backend
from moelora.client.errors import InvalidArgument, MoeLoraError
from moelora.client.layer_set import format_layers
from moelora.client.logs import log_event
from moelora.client.registry import RegistryClient
from shared.refs import AdapterRef
from shared.url_ranges import UrlRangeReader, tls_context

log = logging.getLogger(__name__)

#: ``--download-streams 0`` means half the cores, at least ``_MIN_AUTO_STREAMS`` (one stream
#: stalls while it writes what it received: measured 0.3 GB/s alone, 0.7 GB/s for two on 2
#: cores), at most ``_MAX_AUTO_STREAMS``.
_MIN_AUTO_STREAMS = 2
_MAX_AUTO_STREAMS = 8

#: GetExecutorInfo's ``backend`` per device type.
BACKENDS = {"cuda": "triton", "cpu": "torch-reference"}


@dataclass(frozen=True)
class Placement:
    """Where and in what the executor computes."""

    device: torch.device
    dtype: torch.dtype

    @property
    def kernel_backend(self) -> Backend:
        return "triton" if self.device.type == "cuda" else "torch"

    @property
    def backend_name(self) -> str:
        return BACKENDS[self.device.type]

    @property
    def device_name(self) -> str:
        if self.device.type == "cuda":
            return str(torch.cuda.get_device_name(self.device))
        return "cpu"


def placement(settings: ExecutorSettings) -> Placement:
    """``auto`` = the GPU with bfloat16 if there is one, else the CPU with float32."""
    name = settings.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type not in BACKENDS:
        raise InvalidArgument(f"--device: {settings.device!r} is not auto, cpu, cuda or cuda:N")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidArgument(f"--device: {settings.device!r} but no CUDA GPU is visible")
        device = torch.device("cuda", device.index if device.index is not None else 0)
    dtype_name = settings.dtype
    if dtype_name == "auto":
        dtype_name = "bfloat16" if device.type == "cuda" else "float32"
    return Placement(device=device, dtype=getattr(torch, dtype_name))


@dataclass(frozen=True)
class ExecutorRuntime:
    """Everything a loaded executor serves with."""

    settings: ExecutorSettings
    placement: Placement
    model: BaseModel
    adapters: AdapterManager
    engine: ForwardEngine
    #: Where Forward requests wait to be merged into launches.
    scheduler: Scheduler
    metrics: ExecutorMetrics
    #: The record of a lost device context (see device_fault.py).
    device: DeviceWatch
    #: Where the kernels' launch configurations come from (GetExecutorInfo).
    kernel_configs: tuple[KernelConfigReport, ...] = ()
    #: Follows the registry's changes when adapters come from the registry.
    watcher: RegistryWatcher | None = None
    #: Loads newly aliased versions in the background (--prefetch-on-watch).
    prefetcher: Prefetcher | None = None

    def close(self) -> None:
        """Stops background work (the launch loop, the registry watch, prefetch, the loader's
        threads); the server has drained."""
        self.scheduler.close()
        if self.watcher is not None:
            self.watcher.close()
        if self.prefetcher is not None:
            self.prefetcher.close()
        self.adapters.close()


def replica_name(settings: ExecutorSettings) -> str:
    """``--replica-name``, or the host name: a StatefulSet pod's name, stable across restarts."""
    return settings.replica_name or socket.gethostname()


def download_streams(settings: ExecutorSettings) -> int:
    """``--download-streams``, where 0 means half the cores (see ``_MIN_AUTO_STREAMS``)."""
    auto = max(_MIN_AUTO_STREAMS, min(_MAX_AUTO_STREAMS, default_threads(0)))
    return settings.download_streams or auto


def adapter_source(
    settings: ExecutorSettings, metrics: ExecutorMetrics | None = None
) -> AdapterSource | None:
    """The local adapter folder when ``--adapter-dir`` is set, else the registry when
    ``--registry-address`` is (reporting outages to ``metrics``), else none (base model
    only)."""
    if settings.adapter_dir is not None:
        return LocalFolderSource(settings.adapter_dir.expanduser())
    if settings.registry_address:
        streams = download_streams(settings)
        root_certificates = (
            settings.registry_tls_ca_file.expanduser().read_bytes()
            if settings.registry_tls_ca_file is not None
            else None
        )
        client = RegistryClient(
            settings.registry_address,
            token=settings.registry_token,
            tls=settings.registry_tls,
            root_certificates=root_certificates,
            timeout=settings.registry_timeout_seconds,
            connections=streams,
            keepalive_seconds=settings.registry_keepalive_seconds,
        )
        disk = DiskCache(settings.disk_cache_dir, settings.disk_cache_bytes, check_threads=streams)
        urls = UrlRangeReader(
            timeout=settings.registry_timeout_seconds, ssl_context=tls_context(root_certificates)
        )
        outage = RegistryOutage(
            settings.registry_address,
            on_change=metrics.set_registry_outage if metrics is not None else None,
        )
        return RegistrySource(
            client,
            settings.registry_address,
            disk,
            streams,
            settings.load_nice,
            urls,
            staleness_seconds=settings.registry_staleness_seconds,
            resolve_timeout=settings.registry_resolve_timeout_seconds,
            outage=outage,
        )
    return None


def host_pool(
    settings: ExecutorSettings, buffers: SlotBuffers, metrics: ExecutorMetrics
) -> HostPool:
    """The host cache's memory: its budget, plus room for the packs that may run before their
    put evicts (each at most a slot's bytes), taken at start-up where ``--host-cache-reserve``
    says so, read by the slot writes' stream."""
    device = buffers.sync.device
    reserve = settings.host_cache_reserve
    pool = HostPool(
        settings.host_cache_bytes + CONCURRENT_PACKS * buffers.slot_bytes,
        device,
        reserve=reserve == "on" or (reserve == "auto" and device.type == "cuda"),
        reader=buffers.sync.copy_stream,
        on_fresh=metrics.host_pool_overflow_bytes.inc,
    )
    metrics.host_pool_mapped_bytes.set_function(lambda: pool.reserved_bytes)
    metrics.host_pool_used_bytes.set_function(lambda: pool.used_bytes)
    return pool


def _runner(
    settings: ExecutorSettings,
    where: Placement,
    model: BaseModel,
    adapters: AdapterManager,
    kernel: KernelFn,
    sync: DeviceSync,
    metrics: ExecutorMetrics,
) -> Runner:
    """Eager on the CPU; on a GPU pinned staging and, unless ``--cuda-graphs off``, graphs."""
    if where.device.type != "cuda":
        if settings.cuda_graphs == "on":
            raise InvalidArgument("--cuda-graphs on needs a CUDA device")
        return Runner(kernel, sync, where.dtype, metrics)
    with sync.on_device():
        staging = Staging(model.spec.hidden_size, where.dtype, settings.max_batch_tokens)
        graphs = None
        if settings.cuda_graphs != "off":
            graphs = GraphCache(
                kernel,
                model.layers,
                adapters.lora_slots,
                where.device,
                where.dtype,
                graph_buckets(settings.max_batch_tokens),
            )
            # Before SERVING, before any load or watch thread starts: see graphs.py.
            report = graphs.capture_all()
            metrics.cuda_graphs.set(report.graphs)
            metrics.cuda_graph_bytes.set(report.bytes)
    return Runner(kernel, sync, where.dtype, metrics, graphs, staging)


def build_runtime(
    settings: ExecutorSettings,
    metrics: ExecutorMetrics,
    kernel: KernelFn | None = None,
    source: AdapterSource | None = None,
) -> ExecutorRuntime:
    """Loads the base model and builds every part. ``kernel`` replaces
    ``kernels.moe_forward`` (tests slow it down); ``source`` replaces the configured one."""
    if settings.base_model_path is None:
        raise InvalidArgument("--base-model-path is not set")
    where = placement(settings)
    folder = settings.base_model_path.expanduser()
    model = load_base_model(
        folder, where.device, where.dtype, settings.base_model_name, settings.layer_set,
        settings.fp8_activations,
    )  # fmt: skip
    # Tuned (or autotuned, within its budget) before any graph is captured or request served.
    configs = prepare_kernel_configs(settings, where.device, model)
    sync = DeviceSync(where.device)
    buffers = SlotBuffers(model.layers, settings.num_slots, settings.max_rank, where.dtype, sync)
    pack = PackSettings(
        spec=model.spec,
        base_model_name=model.name,
        max_rank=settings.max_rank,
        dtype=where.dtype,
        layers=frozenset(model.layers),
        device=where.device,
        page_cache_dma=settings.page_cache_dma,
    )
    host = HostCache(settings.host_cache_bytes, host_pool(settings, buffers, metrics))
    if where.device.type == "cuda":  # the pack's kernels loaded now, not in the first load
        seconds = warm_up_packing(pack, host.memory)
        log_event(log, "packing_warmed_up", seconds=round(seconds, 4))
    manager = AdapterManager(
        source=source if source is not None else adapter_source(settings, metrics),
        pack=pack,
        host=host,
        slots=SlotManager(buffers, LRUPolicy()),
        metrics=metrics,
        loader=Loader(load_threads(settings.load_threads, where.device), settings.load_nice),
    )
    # The loader validated every layer once (kernels.validate_layer): not again per call.
    kernel = kernel or functools.partial(
        kernels.moe_forward,
        backend=where.kernel_backend,
        configs=configs.selector,
        check_layer=False,
    )
    runner = _runner(settings, where, model, manager, kernel, sync, metrics)
    engine = ForwardEngine(
        model=model,
        adapters=manager,
        settings=EngineSettings(max_tokens_per_request=settings.max_tokens_per_request),
        runner=runner,
        metrics=metrics,
    )
    watch = DeviceWatch(f"{where.device_name} ({where.device})", metrics)
    scheduler = Scheduler(
        engine.run,
        manager.can_lease,
        SchedulerSettings(
            max_batch_tokens=settings.max_batch_tokens,
            batch_window_us=settings.batch_window_us,
            prepare_during_launch=settings.prepare_during_launch,
            max_queued_requests=settings.max_queued_requests,
        ),
        metrics,
        watch,
        on_start=_launch_thread_setup(settings, where.device),
    )
    watcher = None
    prefetcher = None
    if isinstance(manager.source, RegistrySource):
        if settings.prefetch_on_watch:
            prefetcher = Prefetcher(manager, metrics, settings.prefetch_max_inflight, watch)
            prefetcher.start()
        watcher = RegistryWatcher(
            manager.source.client,
            manager.source,
            on_deleted=manager.forget,
            on_event=prefetcher.offer if prefetcher is not None else None,
        )
        watcher.start()
    elif settings.prefetch_on_watch:
        log_event(log, "prefetch_needs_registry", logging.WARNING, hint="set --registry-address")
    runtime = ExecutorRuntime(
        settings=settings,
        placement=where,
        model=model,
        adapters=manager,
        engine=engine,
        scheduler=scheduler,
        metrics=metrics,
        device=watch,
        kernel_configs=configs.reports,
        watcher=watcher,
        prefetcher=prefetcher,
    )
    for text in settings.preload_adapters:
        ref = AdapterRef.parse(text, "preload_adapters")
        try:
            status = manager.pin(ref, settings.slot_wait_seconds)
        except MoeLoraError as exc:
            # Serving without one preloaded adapter beats not serving at all (the registry
            # may be briefly down); it will be pulled on first use.
            log_event(log, "adapter_preload_failed", logging.WARNING, adapter=text, error=str(exc))
            continue
        log_event(log, "adapter_preloaded", adapter=status.adapter.label, slot=status.slot)
    log_event(
        log,
        "executor_ready",
        base_model=model.name,
        fingerprint=model.spec.fingerprint,
        device=where.device_name,
        dtype=str(where.dtype).removeprefix("torch."),
        weight_format=model.weight_format,
        base_model_bytes=model.nbytes,
        backend=where.backend_name,
        moe_layers=len(model.layers),
        served_layers=format_layers(model.layers),
        replica=replica_name(settings),
    )
    return runtime


def _launch_thread_setup(
    settings: ExecutorSettings, device: torch.device
) -> Callable[[], object] | None:
    """What the launch loop's thread sets for itself first: on a GPU, its torch thread count
    (``--launch-torch-threads``; on the CPU the loop computes, with the process's count)."""
    if device.type != "cuda" or settings.launch_torch_threads == 0:
        return None
    return functools.partial(limit_torch_threads, settings.launch_torch_threads)
