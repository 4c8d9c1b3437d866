"""What a benchmark or stress answer must match: the same request computed alone and eagerly.

``EagerReference`` builds the executor's own runtime in this process with CUDA graphs off and
runs each request through its engine by itself (no merging, no padding to a graph bucket, no
gRPC). A served answer that differs from it beyond rounding was hurt by batching, graph replay
or a race, which is what the stress run hunts; the kernels themselves are checked against
float64 and PEFT by the parity tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from prometheus_client import CollectorRegistry

from executor_service.batch import Segment
from executor_service.config import ExecutorSettings
from executor_service.engine import ForwardInput
from executor_service.metrics import ExecutorMetrics
from executor_service.runtime import ExecutorRuntime, build_runtime


class EagerReference:
    """The executor's engine in-process, one request per launch, graphs off."""

    def __init__(
        self,
        checkpoint: Path,
        adapter_dir: Path,
        device: str,
        max_rank: int,
        cache_dir: Path,
        num_slots: int = 8,
    ) -> None:
        settings = ExecutorSettings.model_validate(
            {
                "listen": "127.0.0.1:0",
                "base_model_path": checkpoint,
                "adapter_dir": adapter_dir,
                "registry_address": "",
                "device": device,
                "num_slots": num_slots,
                "max_rank": max_rank,
                "cuda_graphs": "off",
                "kernel_autotune_seconds": 0,
                "host_cache_bytes": 512 * 1024**2,
                "host_cache_reserve": "off",
                "disk_cache_dir": cache_dir,
                "metrics_listen": "",
            }
        )
        self._runtime: ExecutorRuntime = build_runtime(
            settings, ExecutorMetrics(CollectorRegistry())
        )

    def forward(
        self, layer: int, hidden_bf16: np.ndarray, segments: Sequence[tuple[int, str]]
    ) -> np.ndarray:
        """(T, H) float32 of a request whose hidden states are bfloat16 bits (T, H) uint16."""
        bits = torch.from_numpy(np.array(hidden_bf16, dtype=np.uint16).view(np.int16))
        request = ForwardInput(
            layer=layer,
            hidden=bits.view(torch.bfloat16),
            segments=[Segment(n, adapter) for n, adapter in segments],
        )
        engine = self._runtime.engine
        prepared = engine.prepare(request, slot_wait=60.0)
        engine.run([prepared])
        return prepared.output.float().numpy()

    def close(self) -> None:
        self._runtime.close()
