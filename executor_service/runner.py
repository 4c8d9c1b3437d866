"""One launch on the device: the merged input in, the merged output out (on the CPU, or, for
requests in clients' CUDA memory, on the device).

On the CPU the kernel runs eagerly on the concatenated rows. On a GPU the rows go into
page-locked ``Staging`` buffers, which the GPU's threads read and write across the bus (no copy
engine: ``kernels/host_copy.py``). A launch whose token count fits a CUDA-graph bucket fills
the graphs' staging and replays that graph, copies included (padded rows carry slot -1); a
longer one or one with caller-given routing runs eagerly through the runner's own staging.
Requests whose tensors are in clients' CUDA memory are gathered and scattered on the device
around a graph of their own (``GraphCache.get(..., device_io=True)``), or an eager launch.
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
    #: When the parts are on the GPU (clients' CUDA memory): per request, where its rows go,
    #: written before the launch's synchronisation. None: the caller copies them from the
    #: returned rows.
    outputs: Sequence[torch.Tensor] | None = None


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
            if launch.outputs is not None:
                if graph is not None:
                    return self._replay_on_device(launch, graph, launch.outputs)
                return self._run_eager_on_device(launch, self._staging, launch.outputs)
            if graph is not None:
                return self._replay(launch, graph)
            return self._run_eager(launch, self._staging)

    def _graph(self, launch: Launch) -> LayerGraph | None:
        if self._graphs is None or launch.routing is not None:
            return None
        bucket = self._graphs.bucket(sum(int(p.shape[0]) for p in launch.parts))
        if bucket is None:
            return None
        return self._graphs.get(launch.layer_index, bucket, device_io=launch.outputs is not None)

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
        self._count_replay(graph, staged - start)
        return io.output[:rows]

    def _count_replay(self, graph: LayerGraph, staging_seconds: float) -> None:
        """A replay's metrics, once its end event is reached."""
        begin, end = self._events[:2]
        self._metrics.graph_runs.inc()
        self._metrics.graph_replays.labels(str(graph.bucket)).inc()
        self._metrics.stage["stage"].observe(staging_seconds)
        self._metrics.stage["kernel"].observe(begin.elapsed_time(end) / 1000)

    def _replay_on_device(
        self, launch: Launch, graph: LayerGraph, outputs: Sequence[torch.Tensor]
    ) -> torch.Tensor:
        """A device-I/O graph: the parts gathered into its input on the device, its output
        scattered to ``outputs`` there; only the slot ids cross the bus."""
        graphs = self._graphs
        assert graphs is not None
        start = time.perf_counter()
        rows = sum(int(p.shape[0]) for p in launch.parts)
        graphs.staging.fill_slots(launch.token_slots, rows, pad_to=graph.bucket)
        _gather(launch.parts, graphs.device_input(rows))
        staged = time.perf_counter()
        begin, end = self._events[:2]
        begin.record()
        graph.replay()
        end.record()
        out = graphs.device_output(rows)
        _scatter(out, outputs)
        if launch.meanwhile is not None:
            launch.meanwhile()
        torch.cuda.current_stream(self._sync.device).synchronize()
        self._count_replay(graph, staged - start)
        return out

    def _run_eager_on_device(
        self, launch: Launch, staging: Staging, outputs: Sequence[torch.Tensor]
    ) -> torch.Tensor:
        device = self._sync.device
        start = time.perf_counter()
        rows = sum(int(p.shape[0]) for p in launch.parts)
        hidden = torch.empty(rows, launch.layer.hidden_size, dtype=self._dtype, device=device)
        _gather(launch.parts, hidden)
        lora = None
        if launch.token_slots is not None:
            staging.fill_slots(launch.token_slots, rows)
            lora = LoRAContext(launch.lora_slots, _on_device(staging.slots[:rows], device))
        routing = None
        if launch.routing is not None:
            pinned = staging.routing(launch.routing)
            routing = Routing(
                topk_ids=_on_device(pinned.topk_ids, device),
                topk_weights=_on_device(pinned.topk_weights, device),
            )
        staged = time.perf_counter()
        events = self._events
        events[0].record()
        out = self._kernel(hidden, launch.layer, lora, routing)
        events[1].record()
        _scatter(out, outputs)
        if launch.meanwhile is not None:
            launch.meanwhile()
        torch.cuda.current_stream(device).synchronize()
        self._metrics.eager_runs.inc()
        self._metrics.stage["stage"].observe(staged - start)
        self._metrics.stage["kernel"].observe(events[0].elapsed_time(events[1]) / 1000)
        return out

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


def _gather(parts: Sequence[torch.Tensor], dest: torch.Tensor) -> None:
    """``dest`` ← the parts one after the other, on the device (casting to its dtype)."""
    if all(p.device == dest.device for p in parts):
        torch.cat([p.to(dest.dtype) for p in parts], out=dest)  # one kernel for all
        return
    at = 0
    for part in parts:  # another GPU's memory, over the peer link: byte copies by our kernel
        rows = int(part.shape[0])
        copy_bytes(dest[at : at + rows], part.to(dest.dtype).contiguous())
        at += rows


def _scatter(rows: torch.Tensor, outputs: Sequence[torch.Tensor]) -> None:
    """Each output ← its rows of ``rows``, on the device (casting to the output's dtype)."""
    pieces = torch.split(rows, [int(o.shape[0]) for o in outputs])
    if all(o.device == rows.device for o in outputs):
        torch._foreach_copy_(list(outputs), list(pieces))
        return
    for output, piece in zip(outputs, pieces, strict=True):
        copy_bytes(output, piece.to(output.dtype).contiguous())
