"""One launch on the device: the merged input in, the merged output out (on the CPU).

On the CPU the kernel runs eagerly on the concatenated rows. On a GPU the rows go into
page-locked ``Staging`` buffers, which the GPU's threads read and write across the bus (no copy
engine: ``kernels/host_copy.py``). A launch whose token count fits a CUDA-graph bucket fills
the graphs' staging and replays that graph, copies included (padded rows carry slot -1); a
longer one or one with caller-given routing runs eagerly through the runner's own staging.
Either way the launch ends with its one synchronisation. Device time comes from CUDA events
read after it: per stage (h2d, kernel, d2h) when eager, the whole replay as "kernel" for a
graph.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from executor_service.batch import KernelFn
from executor_service.graphs import GraphCache, LayerGraph
from executor_service.metrics import ExecutorMetrics
from executor_service.slot_buffers import DeviceSync
from executor_service.staging import Staging
from kernels import LoRAContext, LoRASlots, MoELayerWeights, Routing
from kernels.host_copy import copy_bytes


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
    #: Work for the launching thread between enqueueing the launch on a GPU and waiting for it
    #: (it must not touch the device or the staging). None, and on the CPU: nothing.
    meanwhile: Callable[[], None] | None = None


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
        # Made once, not four driver objects created and destroyed per launch; safe to reuse,
        # as each launch reads its events before the next one records them.
        self._events = (
            [torch.cuda.Event(enable_timing=True) for _ in range(4)]  # type: ignore[no-untyped-call]
            if staging is not None
            else []
        )

    def run(self, launch: Launch) -> torch.Tensor:
        """(ΣT, H) in the compute dtype on the CPU. On a GPU it views page-locked staging:
        read it before the next launch."""
        if self._staging is None:
            return self._run_host(launch)
        with self._sync.on_device():
            graph = self._graph(launch)
            if graph is not None:
                return self._replay(launch, graph)
            return self._run_eager(launch, self._staging)

    def _graph(self, launch: Launch) -> LayerGraph | None:
        if self._graphs is None or launch.routing is not None:
            return None
        bucket = self._graphs.bucket(sum(int(p.shape[0]) for p in launch.parts))
        return None if bucket is None else self._graphs.get(launch.layer_index, bucket)

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

    def _replay(self, launch: Launch, graph: LayerGraph) -> torch.Tensor:
        assert self._graphs is not None
        io = self._graphs.staging
        start = time.perf_counter()
        rows = io.fill(launch.parts, launch.token_slots, pad_to=graph.bucket)
        staged = time.perf_counter()
        begin, end = self._events[:2]
        begin.record()
        graph.replay()
        end.record()
        if launch.meanwhile is not None:
            launch.meanwhile()
        end.synchronize()
        self._metrics.graph_runs.inc()
        self._metrics.graph_replays.labels(str(graph.bucket)).inc()
        self._metrics.stage["stage"].observe(staged - start)
        self._metrics.stage["kernel"].observe(begin.elapsed_time(end) / 1000)
        return io.output[:rows]

    def _run_eager(self, launch: Launch, staging: Staging) -> torch.Tensor:
        device = self._sync.device
        start = time.perf_counter()
        rows = staging.fill(launch.parts, launch.token_slots)
        routing = None if launch.routing is None else staging.routing(launch.routing)
        staged = time.perf_counter()
        events = self._events
        events[0].record()
        hidden = _on_device(staging.input[:rows], device)
        lora = None
        if launch.token_slots is not None:
            lora = LoRAContext(launch.lora_slots, _on_device(staging.slots[:rows], device))
        if routing is not None:
            routing = Routing(
                topk_ids=_on_device(routing.topk_ids, device),
                topk_weights=_on_device(routing.topk_weights, device),
            )
        events[1].record()
        out = self._kernel(hidden, launch.layer, lora, routing)
        self._metrics.eager_runs.inc()
        events[2].record()
        copy_bytes(staging.output[:rows], out.contiguous())
        events[3].record()
        if launch.meanwhile is not None:
            launch.meanwhile()
        events[3].synchronize()
        stage = self._metrics.stage
        stage["stage"].observe(staged - start)
        for i, name in enumerate(("h2d", "kernel", "d2h")):
            stage[name].observe(events[i].elapsed_time(events[i + 1]) / 1000)
        return staging.output[:rows]


def _on_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A device copy of page-locked ``host``, read by the GPU's threads (no copy engine)."""
    out = torch.empty(host.shape, dtype=host.dtype, device=device)
    copy_bytes(out, host)
    return out
