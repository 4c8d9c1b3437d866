"""Executor settings: each field is a flag and a MOELORA_* environment variable."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field

from shared.config import ServerSettings


class ExecutorSettings(ServerSettings):
    """Embedded defaults: 127.0.0.1, the GPU if there is one (else the CPU with the
    torch reference), adapters from the registry on 127.0.0.1:50051."""

    prog_name: ClassVar[str] = "moelora-executor"

    listen: str = Field("127.0.0.1:50052", description="host:port the gRPC server listens on")
    base_model_path: Path | None = Field(
        None, description="Hugging Face checkpoint folder (config.json + *.safetensors)"
    )
    base_model_name: str | None = Field(
        None, description="the base model's registry name; default: the folder's name"
    )
    device: str = Field("auto", description="auto, cpu, cuda or cuda:N")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="compute dtype; auto = bfloat16 on a GPU, float32 on a CPU"
    )
    num_slots: int = Field(8, ge=2, description="GPU adapter slots per MoE layer")
    max_rank: int = Field(16, ge=1, le=512, description="largest LoRA rank a slot holds")
    host_cache_bytes: int = Field(
        4 * 1024**3, ge=0, description="byte budget of the host-memory adapter cache"
    )
    registry_address: str | None = Field(
        "127.0.0.1:50051", description="registry host:port adapters are pulled from; empty: none"
    )
    registry_token: str | None = Field(None, description="bearer token for the registry")
    registry_tls: bool = Field(False, description="talk TLS to the registry")
    registry_timeout_seconds: float = Field(
        30.0, gt=0, description="deadline of each registry call (downloads excepted)"
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
    max_message_bytes: int = Field(
        512 * 1024 * 1024, ge=4 * 1024 * 1024, description="largest gRPC message in bytes"
    )
    kernel_autotune_seconds: float = Field(
        300.0,
        ge=0,
        description="start-up budget for autotuning the MoE kernels when this GPU has no tuned "
        "table for the model's shape and rank (before SERVING; cached on disk); 0 = heuristic "
        "configurations only",
    )
    kernel_cache_dir: Path = Field(
        Path("~/.moelora/kernel-configs"),
        description="on-disk cache of autotuned kernel configurations (per GPU, Triton "
        "version, shape and rank)",
    )
    metrics_listen: str = Field(
        "127.0.0.1:9402", description="host:port of the Prometheus /metrics endpoint; empty: off"
    )
