"""Executor settings: each field is a flag and a MOELORA_EXECUTOR_* environment variable."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, field_validator
from pydantic_settings import SettingsConfigDict

from moelora.client import keepalive
from moelora.client.errors import InvalidArgument
from moelora.client.layer_set import parse_layers
from shared.config import ServerSettings


class ExecutorSettings(ServerSettings):
    """Embedded defaults: 127.0.0.1, the GPU if there is one (else the CPU with the
    torch reference), adapters from the registry on 127.0.0.1:50051."""

    model_config = SettingsConfigDict(env_prefix="MOELORA_EXECUTOR_")
    prog_name: ClassVar[str] = "moelora-executor"

    listen: str = Field("127.0.0.1:50052", description="host:port the gRPC server listens on")
    base_model_path: Path | None = Field(
        None,
        description="Hugging Face checkpoint folder (config.json + *.safetensors); required "
        "to serve",
    )
    base_model_name: str | None = Field(
        None, description="the base model's registry name; default: the folder's name"
    )
    device: str = Field("auto", description="auto, cpu, cuda or cuda:N")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="compute dtype; auto = bfloat16 on a GPU, float32 on a CPU"
    )
    fp8_activations: bool = Field(
        False,
        description="FP8 checkpoints: quantise the experts' inputs to FP8 per token and 128 "
        "columns and multiply on the FP8 tensor cores (W8A8, the numerics of DeepSeek-V3's "
        "reference code; on Hopper GPUs from batches of about 200 tokens up the fastest FP8 "
        "path, under 0.9 of bf16's time), answers within a few 1e-2 of the unquantised "
        "computation; off: the inputs stay in the compute dtype (W8A16). An error for a "
        "checkpoint whose experts are not FP8",
    )
    num_slots: int = Field(8, ge=2, description="GPU adapter slots per MoE layer")
    max_rank: int = Field(16, ge=1, le=512, description="largest LoRA rank a slot holds")
    host_cache_bytes: int = Field(
        4 * 1024**3, ge=0, description="byte budget of the host-memory adapter cache"
    )
    host_cache_reserve: Literal["auto", "on", "off"] = Field(
        "auto",
        description="take the host cache's memory at start-up (its budget plus room for the "
        "packs in flight; page-locked on a GPU) rather than as the first adapters fill it; "
        "either way it is kept and recycled, never handed back: auto = on a CUDA executor",
    )
    registry_address: str | None = Field(
        "127.0.0.1:50051", description="registry host:port adapters are pulled from; empty: none"
    )
    registry_token: str | None = Field(
        None,
        description="bearer token the executor presents to the registry (role read); "
        "not one it accepts: those are in auth_tokens_file",
    )
    registry_tls: bool = Field(False, description="talk TLS to the registry")
    registry_tls_ca_file: Path | None = Field(
        None, description="PEM roots that sign the registry's certificate; default: the system's"
    )
    auth: Literal["auto", "on", "off"] = Field(
        "auto", description="bearer-token auth on this server: auto = on unless on loopback"
    )
    auth_tokens_file: Path | None = Field(
        None,
        description="JSON file of hashed tokens with roles, the registry's format: Forward "
        "and the listings need read, Load/Unload/Pin/Unpin need admin",
    )
    registry_timeout_seconds: float = Field(
        30.0, gt=0, description="deadline of each registry call (downloads excepted)"
    )
    registry_staleness_seconds: float = Field(
        10.0,
        gt=0,
        description="how long what a reference (an alias, a bare name, name:VERSION) resolved "
        "to is trusted without the registry's change stream vouching for it; older answers "
        "are asked again before use while the registry answers, and served as they are while "
        "it does not",
    )
    registry_resolve_timeout_seconds: float = Field(
        2.0,
        gt=0,
        description="deadline of a reference resolution a Forward waits on: a registry that "
        "stopped answering costs one request at most this long, then the outage is known and "
        "nothing waits on it",
    )
    registry_keepalive_seconds: float = Field(
        keepalive.DEFAULT_KEEPALIVE_SECONDS,
        ge=keepalive.MIN_CLIENT_PING_SECONDS,
        description="ping the registry after this long without a word from it while a call "
        "is open (a download, the watch); no answer within as long again fails the "
        "connection's calls: a dead connection cannot hold a load or the watch",
    )
    adapter_dir: Path | None = Field(
        None,
        description="local folder of adapters (NAME/ or NAME/VERSION/ subfolders), used "
        "instead of the registry",
    )
    disk_cache_dir: Path = Field(
        Path("~/.moelora/executor-cache"), description="local disk cache of downloaded adapters"
    )
    disk_cache_bytes: int = Field(20 * 1024**3, ge=0, description="byte budget of the disk cache")
    download_streams: int = Field(
        0,
        ge=0,
        le=64,
        description="parallel ranged reads (each over a connection of its own) that download "
        "one adapter; 0 = half the CPU cores, 2 to 8",
    )
    load_threads: int = Field(
        0,
        ge=0,
        le=256,
        description="CPU threads that pack one adapter (torch intra-op threads of the loader); "
        "0 = 1 on a CUDA executor (the GPU packs; the threads read bytes into staging where "
        "the page cache is not copied from directly: more load faster but slow Forward more "
        "while they do), half the CPU cores on a CPU one",
    )
    page_cache_dma: bool = Field(
        False,
        description="on a CUDA executor, copy adapter files to the GPU straight from the OS "
        "page cache (their pages registered read-only with the driver, where the device "
        "supports it) rather than through page-locked staging buffers: disk-warm loads about "
        "twice as fast, but Forward beside them slows more (H100 medians: 8.3 against 4.5 "
        "GB/s, Forward p50 +68% against +13% during disk-warm loads)",
    )
    load_nice: int = Field(
        19,
        ge=0,
        le=19,
        description="how much lower the CPU priority of downloads, checks and packing runs than "
        "Forward's (Linux nice, per thread), so that serving keeps its speed while adapters load",
    )
    prefetch_on_watch: bool = Field(
        False,
        description="load a version into the host cache in the background when the "
        "registry's watch stream reports an alias set or moved to it (registry source only)",
    )
    prefetch_max_inflight: int = Field(
        2,
        ge=1,
        description="background prefetches running at once; 8 per worker wait in a queue, "
        "beyond that the oldest is dropped",
    )
    preload_adapters: list[str] = Field(
        default_factory=list, description="adapter references to load and pin at start-up"
    )
    slot_wait_seconds: float = Field(
        5.0,
        ge=0,
        description="how long a request may wait for GPU slots busy with requests in flight "
        "before RESOURCE_EXHAUSTED (capped by its deadline)",
    )
    max_tokens_per_request: int = Field(
        16384, ge=1, description="largest T a Forward request may carry"
    )
    grpc_workers: int = Field(
        64,
        ge=1,
        description="gRPC handler threads: the most Forward calls in flight at once (an open "
        "ForwardStream holds one for its lifetime)",
    )
    max_forward_streams: int | None = Field(
        None,
        ge=1,
        description="ForwardStream streams open at once, each holding a handler thread; more "
        "are refused with RESOURCE_EXHAUSTED and a retry hint; default: 3/4 of grpc_workers",
    )
    frontends: int | None = Field(
        None,
        ge=0,
        le=64,
        description="gRPC front-end processes on the one --listen port (each decodes, checks "
        "and encodes requests under its own GIL and hands them to the GPU's engine process "
        "through shared memory); 0 = serve gRPC in the engine's process; default: one per "
        "two cores, 1 to 8",
    )
    channel_dir: Path | None = Field(
        None,
        description="directory of the engine's socket for direct channels (same-host clients "
        "that send Forward descriptors to the engine without a gRPC call each; OpenChannel "
        "tells them the path): share it with client containers; default: a private "
        "temporary directory",
    )
    max_channel_in_flight: int = Field(
        64,
        ge=1,
        description="Forward requests one direct channel may have in flight; more are answered "
        "RESOURCE_EXHAUSTED with a retry hint",
    )
    channel_spin_us: int = Field(
        2000,
        ge=0,
        le=1_000_000,
        description="microseconds the launch loop keeps polling direct channels' spin blocks "
        "after their last request (a channel that asks for one: its descriptors and answers "
        "in shared memory, no socket or thread wake-up per call; the loop's core is busy "
        "meanwhile); 0: channels do not spin",
    )
    max_spin_channels: int = Field(
        64,
        ge=0,
        le=1024,
        description="direct channels with a spin block at once (the launch loop reads every "
        "block each time it looks); a channel asking past it works over its socket",
    )
    network_channel_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="TCP port of the engine's network channels (clients on other hosts or "
        "GPUs: Forward descriptors over TCP, the tensors GPU to GPU over a torch.distributed "
        "process group per channel, NCCL; Gloo on a CPU executor); 0: any free port; unset: "
        "no network channels",
    )
    network_channel_host: str | None = Field(
        None,
        description="the address clients on other hosts reach this executor's engine at "
        "(OpenChannel tells them; in Kubernetes the pod IP); default: this host's name "
        "resolved",
    )
    network_channel_buffer_bytes: int = Field(
        64 * 1024**2,
        ge=1024**2,
        description="device memory one network channel may hold for a request's input and "
        "output together (its buffer grows to its largest request up to this): a larger "
        "request ends the channel; every open channel may hold this much outside the slot "
        "budget",
    )
    max_network_channels: int = Field(
        16,
        ge=1,
        le=1024,
        description="network channels open at once (each holds a process group, its GPU "
        "buffers and a reader thread); more are turned away",
    )
    max_channels_per_token: int = Field(
        256,
        ge=1,
        description="direct and network channels one bearer token may hold at once, its "
        "OpenChannel tickets not yet used counted in, so that one caller cannot take the "
        "engine's channels from the others; more are RESOURCE_EXHAUSTED (with auth off "
        "every caller shares one scope and the engine-wide limits alone apply)",
    )
    frontend_combine_after: int = Field(
        2,
        ge=0,
        description="Forward requests of one gRPC front end in the engine at once before "
        "more wait and go combined: the requests that wait share one descriptor (their rows "
        "one after the other, up to --max-batch-tokens), so the engine's launch loop does its "
        "per-request work once for all of them; 0: every request goes alone",
    )
    frontend_arena_bytes: int = Field(
        1024**3,
        ge=16 * 1024**2,
        description="shared memory (/dev/shm) each gRPC front end holds for its requests' "
        "input and output tensors on their way to and from the engine; a request needs about "
        "twice its hidden_states' bytes while it is served (pages are taken as they are used)",
    )
    frontend_arena_pinned_bytes: int = Field(
        64 * 1024**2,
        ge=0,
        description="on a GPU, the first bytes of each front end's arena that the engine "
        "page-locks (taken at once): requests whose tensors lie there are read and written by "
        "the GPU in place, with no copy on the launch loop (the allocator fills the arena from "
        "its start); 0: every request is copied through staging",
    )
    shared_memory_pinned_bytes: int = Field(
        256 * 1024**2,
        ge=0,
        description="on a GPU, bytes of clients' shared-memory regions (RegisterSharedMemory) "
        "that the engine page-locks as they are registered, all regions together, the start of "
        "each, first registered first served: requests whose tensors lie there are read and "
        "written by the GPU in place instead of copied through staging (on an H200, 32 "
        "clients at T = 64: 196 k against 121 k tokens/s); 0: off",
    )
    gil_switch_interval_us: int = Field(
        200,
        ge=1,
        description="Python's thread switch interval in microseconds (sys.setswitchinterval); "
        "the launch loop waits up to this long for the GIL after each GPU call while other "
        "threads (front-end readers, loads) run (Python's default: 5000)",
    )
    launch_torch_threads: int = Field(
        1,
        ge=0,
        description="torch intra-op threads of the launch loop on a GPU (its copies of "
        "requests' rows into and out of page-locked staging); 0: the process's count. One "
        "thread copies a launch's rows in well under a millisecond, and waits for no other: "
        "on a host busy with gRPC front ends, a team of threads waits for its slowest",
    )
    max_batch_tokens: int = Field(
        512,
        ge=1,
        description="requests for the same layer waiting together are merged into one launch "
        "of up to this many tokens (a longer request runs alone); on a GPU, CUDA graphs are "
        "captured for powers of two below it and for it (more graphs and start-up time as it "
        "grows)",
    )
    batch_window_us: int = Field(
        0,
        ge=0,
        description="how long an idle GPU waits for more requests to merge, in microseconds "
        "(0 = never wait)",
    )
    prepare_during_launch: bool = Field(
        True,
        description="on a GPU, the launch loop prepares newly arrived requests while the "
        "device computes a launch, instead of waiting for it first; false: after it",
    )
    max_queued_requests: int = Field(
        256,
        ge=1,
        description="Forward requests waiting for the GPU beyond which new ones are refused "
        "with RESOURCE_EXHAUSTED and a retry hint",
    )
    cuda_graphs: Literal["auto", "on", "off"] = Field(
        "auto",
        description="replay the layer forward from CUDA graphs per token bucket; auto = on a GPU",
    )
    max_message_bytes: int = Field(
        512 * 1024 * 1024, ge=4 * 1024 * 1024, description="largest gRPC message in bytes"
    )
    kernel_autotune_seconds: float = Field(
        0.0,
        ge=0,
        description="start-up budget for autotuning the MoE kernels when this GPU has no tuned "
        "table for the model's shape and rank (before SERVING; cached on disk); 0 = the "
        "heuristic's configurations (budgets under a minute found nothing faster, 150 s found "
        "5-11%: kernels/BENCHMARKS.md)",
    )
    kernel_cache_dir: Path = Field(
        Path("~/.moelora/kernel-configs"),
        description="on-disk cache of autotuned kernel configurations (per GPU, Triton "
        "version, shape and rank)",
    )
    metrics_listen: str = Field(
        "127.0.0.1:9402", description="host:port of the Prometheus /metrics endpoint; empty: off"
    )
    layers: str | None = Field(
        None,
        description="MoE layers this executor serves, as ranges and lists (0-23,30); empty: "
        "all. Only these are loaded, packed and budgeted",
    )
    replica_name: str | None = Field(
        None,
        description="name GetExecutorInfo reports for this replica; default: the host name "
        "(a StatefulSet pod's name)",
    )

    @field_validator("layers")
    @classmethod
    def _check_layers(cls, value: str | None) -> str | None:
        if not value:
            return None
        try:
            parse_layers(value, "--layers")
        except InvalidArgument as exc:
            raise ValueError(exc.message) from None
        return value

    @property
    def layer_set(self) -> tuple[int, ...] | None:
        """The parsed ``layers``, or None for every MoE layer."""
        return None if self.layers is None else parse_layers(self.layers, "--layers")
