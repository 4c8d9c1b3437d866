"""The executor's Prometheus metrics.

One ``ExecutorMetrics`` per executor, registered in a ``CollectorRegistry`` (the process-wide
default in production; tests pass their own so that several executors in one process do not
collide). The parts that do the work (engine, adapter manager) update it; the host cache and
the slot manager stay metric-free and report what they did in their return values.

Tiers are ``gpu`` (a slot) and ``host`` (the packed host-memory cache).
"""

from __future__ import annotations

import contextlib
import time

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

#: The adapter tiers (label ``tier``): a slot, the packed host-memory cache.
TIERS = ("gpu", "host")
#: Outcomes of a background prefetch (label ``result``).
PREFETCH_RESULTS = ("loaded", "held", "failed", "dropped")

_LATENCY_BUCKETS = (
    0.0002,
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.02,
    0.05,
    0.1,
    0.2,
    0.5,
    1,
    2,
    5,
    10,
)


#: Finer buckets for the stages of one Forward (tens of microseconds upwards).
_STAGE_BUCKETS = (
    0.00002,
    0.00005,
    0.0001,
    0.0002,
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.02,
    0.05,
    0.1,
    0.5,
    2,
)

#: A Forward's stages, in order (``moelora_executor_stage_seconds{stage}``): per descriptor
#: (a request, or a front end's combined requests) for decode, dispatch, prepare and queue; per
#: launch for the others.
STAGES = ("decode", "dispatch", "prepare", "queue", "stage", "h2d", "kernel", "d2h", "encode")


class ExecutorMetrics:
    """Every metric the executor exports."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.forward_seconds = Histogram(
            "moelora_executor_forward_seconds",
            "Forward compute time per launch (requests merged into one): slots leased, rows "
            "in, kernel, outputs written",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.forward_tokens = Counter(
            "moelora_executor_forward_tokens_total",
            "Tokens computed by Forward, by kind (lora: with an adapter, base: without)",
            ["kind"],
            registry=registry,
        )
        self.forward_transports = Counter(
            "moelora_executor_forward_requests_by_transport_total",
            "Forward requests by where their tensors came from: message (bytes in the RPC), "
            "shared_memory (a client's registered shared memory), cuda_memory (a client's "
            "registered CUDA memory, read and written on the GPU), network_channel (received "
            "over a network channel's process group)",
            ["transport"],
            registry=registry,
        )
        self.cache_hits = Counter(
            "moelora_executor_adapter_hits_total",
            "Adapter lookups that found the adapter in the tier",
            ["tier"],
            registry=registry,
        )
        self.cache_misses = Counter(
            "moelora_executor_adapter_misses_total",
            "Adapter lookups that had to bring the adapter into the tier",
            ["tier"],
            registry=registry,
        )
        self.evictions = Counter(
            "moelora_executor_adapter_evictions_total",
            "Adapters evicted from the tier to make room (least recently used first)",
            ["tier"],
            registry=registry,
        )
        self.load_seconds = Histogram(
            "moelora_executor_adapter_load_seconds",
            "Time to bring one adapter into the tier (host: fetch + verify + pack; gpu: copy)",
            ["tier"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.load_bytes = Counter(
            "moelora_executor_adapter_load_bytes_total",
            "Packed adapter bytes brought into the tier",
            ["tier"],
            registry=registry,
        )
        self.prefetches = Counter(
            "moelora_executor_prefetches_total",
            "Background prefetches of newly aliased adapters (--prefetch-on-watch) by result: "
            "loaded, held (already in a slot or the host cache), failed, dropped (queue full)",
            ["result"],
            registry=registry,
        )
        self.resident = Gauge(
            "moelora_executor_adapter_resident",
            "1 for each adapter version (name:VERSION) held in the tier; routers read this",
            ["adapter", "tier"],
            registry=registry,
        )
        self.host_cache_used_bytes = Gauge(
            "moelora_executor_host_cache_used_bytes",
            "Bytes of packed adapters in the host cache",
            registry=registry,
        )
        self.host_pool_mapped_bytes = Gauge(
            "moelora_executor_host_pool_mapped_bytes",
            "Bytes of host memory the host cache's pool has mapped (its slabs, kept and "
            "recycled): page-locked and resident on a GPU executor or when reserved at "
            "start-up; otherwise pages become resident as packs first touch them "
            "(process_resident_memory_bytes is the process's resident memory)",
            registry=registry,
        )
        self.host_pool_used_bytes = Gauge(
            "moelora_executor_host_pool_used_bytes",
            "Bytes of the pool's slabs that hold packed adapters now",
            registry=registry,
        )
        self.host_pool_overflow_bytes = Counter(
            "moelora_executor_host_pool_overflow_bytes",
            "Bytes of packed tensors the host cache's pool had no room for (allocated outside "
            "it, as fresh memory)",
            registry=registry,
        )
        self.channels_open = Gauge(
            "moelora_executor_channels_open",
            "Channels to the engine open now, by kind: direct (same-host clients over a Unix "
            "socket) and network (clients on other hosts or GPUs: TCP and a process group each)",
            ["kind"],
            registry=registry,
        )
        self.gpu_slots = Gauge(
            "moelora_executor_gpu_slots",
            "GPU adapter slots by state (free, loaded, pinned)",
            ["state"],
            registry=registry,
        )

        # vLLM's ``vllm:lora_requests_info`` convention, which LoRA-aware routers (Gateway API
        # Inference Extension, llm-d) read: one series, labels listing adapters, value = time
        # of the last change. running = adapters in GPU slots; waiting is always empty (a
        # request waits only for busy slots, not in a per-adapter queue).
        self.lora_requests_info = Gauge(
            "moelora_executor_lora_requests_info",
            "Adapters in GPU slots (running_lora_adapters, comma-separated name:VERSION), "
            "waiting_lora_adapters and max_lora (slots), as vLLM's lora_requests_info",
            ["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
            registry=registry,
        )
        self.batch_requests = Histogram(
            "moelora_executor_batch_requests",
            "Requests merged into one launch",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64),
            registry=registry,
        )
        self.batch_tokens = Histogram(
            "moelora_executor_batch_tokens",
            "Tokens of one launch (before padding to its CUDA-graph bucket)",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384),
            registry=registry,
        )
        self.queue_wait_seconds = Histogram(
            "moelora_executor_queue_wait_seconds",
            "Time a Forward request waited for its batch to start",
            buckets=_STAGE_BUCKETS,
            registry=registry,
        )
        self.queued_requests = Gauge(
            "moelora_executor_queued_requests",
            "Forward requests waiting for the GPU",
            registry=registry,
        )
        self.launch_loop_busy = Counter(
            "moelora_executor_launch_loop_busy_seconds_total",
            "Seconds the engine's launch loop spent working (preparing, launching, answering) "
            "rather than waiting for requests; a rate near 1 means the engine is short of CPU",
            registry=registry,
        )
        self.overloaded = Counter(
            "moelora_executor_overloaded_total",
            "Forward requests refused because --max-queued-requests were waiting",
            registry=registry,
        )
        self.runs = Counter(
            "moelora_executor_forward_runs_total",
            "Launches by mode: graph (CUDA-graph replay) or eager",
            ["mode"],
            registry=registry,
        )
        self.launch_io = Counter(
            "moelora_executor_launch_io_total",
            "Launches on a GPU by how their rows reach the device: staged (copied into "
            "page-locked staging on the launch loop), mapped (read and written in place in a "
            "front end's page-locked arena), device (a client's CUDA memory)",
            ["io"],
            registry=registry,
        )
        self.graph_replays = Counter(
            "moelora_executor_graph_replays_total",
            "CUDA-graph replays by token bucket (a launch of T tokens replays the smallest "
            "bucket >= T)",
            ["bucket"],
            registry=registry,
        )
        self.cuda_graphs = Gauge(
            "moelora_executor_cuda_graphs",
            "CUDA graphs captured at start-up (one per served layer and token bucket)",
            registry=registry,
        )
        self.cuda_graph_bytes = Gauge(
            "moelora_executor_cuda_graph_bytes",
            "Device memory the CUDA graphs' shared pool reserved at capture",
            registry=registry,
        )
        self.device_faults = Counter(
            "moelora_executor_device_faults_total",
            "Sticky device errors (illegal address, launch failure, ECC, device lost); the "
            "first one stops the executor",
            registry=registry,
        )
        self.stage_seconds = Histogram(
            "moelora_executor_stage_seconds",
            "Time per stage: decode (front end), dispatch (the engine's reader to the launch "
            "loop), prepare (check and resolve), queue, stage (into the pinned input), h2d, "
            "kernel, d2h (device times on a GPU), encode",
            ["stage"],
            buckets=_STAGE_BUCKETS,
            registry=registry,
        )
        self.registry_outage_start = Gauge(
            "moelora_executor_registry_outage_start_timestamp_seconds",
            "Unix time since when the registry has not answered and adapters are served from "
            "what this executor had resolved (0 while the registry answers)",
            registry=registry,
        )

        # Every label value a dashboard or alert reads exists from the start (at 0), so that
        # rates and ratios are defined before the first event rather than absent.
        for tier in TIERS:
            for labelled in (
                self.cache_hits,
                self.cache_misses,
                self.evictions,
                self.load_seconds,
                self.load_bytes,
            ):
                labelled.labels(tier)
        for result in PREFETCH_RESULTS:
            self.prefetches.labels(result)

        # Label children resolved once: ``labels()`` costs microseconds on every Forward.
        self.stage = {name: self.stage_seconds.labels(name) for name in STAGES}
        self.graph_runs = self.runs.labels("graph")
        self.eager_runs = self.runs.labels("eager")
        self.lora_tokens = self.forward_tokens.labels("lora")
        self.base_tokens = self.forward_tokens.labels("base")

    def set_registry_outage(self, since: float | None) -> None:
        """Called by ``RegistryOutage`` when an outage starts (its Unix time) and ends (None)."""
        self.registry_outage_start.set(since or 0)

    def set_lora_info(self, running: list[str], max_lora: int) -> None:
        """Replaces the one ``lora_requests_info`` series."""
        self.lora_requests_info.clear()
        series = self.lora_requests_info.labels(",".join(sorted(running)), "", str(max_lora))
        series.set(time.time())

    def set_resident(self, adapter: str, tier: str, resident: bool) -> None:
        """Adds or removes one adapter's series (absent, rather than 0, once it left)."""
        if resident:
            self.resident.labels(adapter, tier).set(1)
            return
        with contextlib.suppress(KeyError):  # it was never set
            self.resident.remove(adapter, tier)
