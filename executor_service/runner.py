"""One launch on the device: the merged input in, the merged output out (on the CPU).

On the CPU the kernel runs eagerly on the concatenated rows. On a GPU the rows go through the
pinned ``Staging`` buffers; a launch whose token count fits a CUDA-graph bucket replays that
graph (padded rows carry slot -1), a longer one or one with caller-given routing runs eagerly;
the output is copied back into pinned memory and the launch ends with its one
synchronisation. Device time per stage comes from CUDA events read after that sync.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from executor_service.batch import KernelFn
from executor_service.graphs import GraphCache
from executor_service.metrics import ExecutorMetrics
from executor_service.slot_buffers import DeviceSync
from executor_service.staging import Staging
from kernels import LoRAContext, LoRASlots, MoELayerWeights, Routing


@dataclass(frozen=True)
class Launch:
    """What one launch computes."""

    layer_index: int
    layer: MoELayerWeights
    #: Per request (T_i, H) on the CPU, any wire dtype.
    parts: Sequence[torch.Tensor]
    #: (ΣT,) int32 on the CPU, -1 for base tokens; None when no token has an adapter.
    token_slots: torch.Tensor | None
    lora_slots: LoRASlots
    routing: Routing | None


class Runner:
    """Runs launches for the one thread that owns the device."""

    def __init__(
        self,
        kernel: KernelFn,
        sync: DeviceSync,
        dtype: torch.dtype,
        metrics: ExecutorMetrics,
        graphs: GraphCache | None = None,
        staging: Staging | None = None,
    ) -> None:
        self._kernel = kernel
        self._sync = sync
        self._dtype = dtype
        self._metrics = metrics
        self._graphs = graphs
        self._staging = staging

    def run(self, launch: Launch) -> torch.Tensor:
        """(ΣT, H) in the compute dtype on the CPU. On a GPU it views the pinned output
        buffer: read it before the next launch."""
        if self._staging is None:
            return self._run_host(launch)
        with self._sync.on_device():
            return self._run_device(launch, self._staging)

    def _run_host(self, launch: Launch) -> torch.Tensor:
        start = time.perf_counter()
        hidden = torch.cat([p.to(self._dtype) for p in launch.parts])
        routing = launch.routing
        lora = None
        if launch.token_slots is not None:
            lora = LoRAContext(launch.lora_slots, launch.token_slots)
        staged = time.perf_counter()
        out = self._kernel(hidden, launch.layer, lora, routing)
        self._metrics.eager_runs.inc()
        self._metrics.stage["stage"].observe(staged - start)
        self._metrics.stage["kernel"].observe(time.perf_counter() - staged)
        return out

    def _run_device(self, launch: Launch, staging: Staging) -> torch.Tensor:
        device = self._sync.device
        start = time.perf_counter()
        rows = staging.fill(launch.parts, launch.token_slots)
        staged = time.perf_counter()
        events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]  # type: ignore[no-untyped-call]
        graph = None
        if self._graphs is not None and launch.routing is None:
            bucket = self._graphs.bucket(rows)
            if bucket is not None:
                graph = self._graphs.get(launch.layer_index, bucket)
        events[0].record()
        if graph is not None:
            graph.input[:rows].copy_(staging.input[:rows], non_blocking=True)
            if launch.token_slots is not None:
                graph.slots[:rows].copy_(staging.slots[:rows], non_blocking=True)
            else:
                graph.slots[:rows].fill_(-1)
            graph.slots[rows:].fill_(-1)
            events[1].record()
            graph.replay()
            out = graph.output[:rows]
            self._metrics.graph_runs.inc()
        else:
            hidden = staging.input[:rows].to(device, non_blocking=True)
            lora = None
            if launch.token_slots is not None:
                slots = staging.slots[:rows].to(device, non_blocking=True)
                lora = LoRAContext(launch.lora_slots, slots)
            routing = launch.routing
            if routing is not None:
                routing = Routing(
                    topk_ids=routing.topk_ids.to(device, non_blocking=True),
                    topk_weights=routing.topk_weights.to(device, non_blocking=True),
                )
            events[1].record()
            out = self._kernel(hidden, launch.layer, lora, routing)
            self._metrics.eager_runs.inc()
        events[2].record()
        staging.output[:rows].copy_(out, non_blocking=True)
        events[3].record()
        events[3].synchronize()
        stage = self._metrics.stage
        stage["stage"].observe(staged - start)
        for i, name in enumerate(("h2d", "kernel", "d2h")):
            stage[name].observe(events[i].elapsed_time(events[i + 1]) / 1000)
        return staging.output[:rows]
