"""One launch on the device: the merged input in, the merged output out (on the CPU, or
written where each request said).

On the CPU the kernel runs eagerly on the concatenated rows. On a GPU the rows reach the
device one of three ways (counted by ``moelora_executor_launch_io_total``):

* **device**: requests whose tensors are in clients' CUDA memory replay a graph of their own
  (``GraphCache.get(..., device_io=True)``) whose first kernel gathers their rows from the
  addresses in the staging's ``sources`` table and whose last scatters the output rows to
  those in ``dests`` (``kernels/host_copy.py``); the launch only writes the two tables. An
  eager launch runs the same kernels around the layer's.
* **mapped**: requests whose tensors lie in page-locked host memory in the compute dtype (a
  front end's pinned arena, a client's pinned shared-memory region) take the same path, the
  kernels reading and writing that memory across the bus: the launch loop copies no rows.
* **staged**: otherwise the launch loop copies the rows into page-locked ``Staging`` buffers
  (casting on the way), which the GPU's threads read and write across the bus (no copy
  engine). A launch whose token count fits a CUDA-graph bucket fills the graphs' staging and
  replays that graph, copies included (padded rows carry slot -1); a longer one or one with
  caller-given routing runs eagerly through the runner's own staging.

Either way the launch ends with its one synchronisation. Device time comes from CUDA events
read after it: per stage (h2d, kernel, d2h) when eager through staging, the whole replay (or
kernel) as "kernel" otherwise.
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
from kernels.host_copy import copy_bytes, gather_rows, scatter_rows


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
    #: When the parts are on the GPU (clients' CUDA memory) or in page-locked host memory the
    #: device reads and writes in place (a front end's pinned arena): per request, where its
    #: rows go, written before the launch's synchronisation. None: the caller copies them
    #: from the returned rows.
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

    def run(self, launch: Launch) -> torch.Tensor | None:
        """None when each request's rows were written to ``launch.outputs`` (on a GPU, for
        device and mapped launches); else (ΣT, H) in the compute dtype on the CPU, for the
        caller to copy out. On a GPU that views page-locked staging: read it before the next
        launch."""
        if self._staging is None:
            return self._run_host(launch)
        with self._sync.on_device():
            outputs = launch.outputs
            on_device = launch.parts[0].is_cuda
            if outputs is not None and (on_device or self._maps(launch, outputs)):
                self._metrics.launch_io.labels("device" if on_device else "mapped").inc()
                graph = self._graph(launch, device_io=True)
                if graph is not None:
                    self._replay_on_device(launch, graph, outputs)
                else:
                    self._run_eager_on_device(launch, self._staging, outputs)
                return None
            self._metrics.launch_io.labels("staged").inc()
            graph = self._graph(launch, device_io=False)
            if graph is not None:
                return self._replay(launch, graph)
            return self._run_eager(launch, self._staging)

    def _maps(self, launch: Launch, outputs: Sequence[torch.Tensor]) -> bool:
        """Whether the GPU can read the host parts and write the outputs in place: they are
        in the compute dtype (the gather and scatter copy bytes, casting nothing)."""
        return all(t.dtype == self._dtype for t in (*launch.parts, *outputs))

    def _graph(self, launch: Launch, device_io: bool) -> LayerGraph | None:
        if self._graphs is None or launch.routing is not None:
            return None
        bucket = self._graphs.bucket(sum(int(p.shape[0]) for p in launch.parts))
        if bucket is None:
            return None
        return self._graphs.get(launch.layer_index, bucket, device_io=device_io)

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
    ) -> None:
        """A device-I/O graph: it gathers the parts' rows from where they lie and scatters
        its output rows to ``outputs`` (across the bus for mapped host memory); the launch
        only writes the graph's address tables."""
        graphs = self._graphs
        assert graphs is not None
        start = time.perf_counter()
        io = graphs.staging
        rows, _sources, targets = self._addresses(launch, outputs, io, pad_to=graph.bucket)
        io.fill_slots(launch.token_slots, rows, pad_to=graph.bucket)
        staged = time.perf_counter()
        stream = torch.cuda.current_stream(self._sync.device)  # once: each lookup costs µs
        begin, end = self._events[:2]
        begin.record(stream)
        graph.replay()
        end.record(stream)
        _copy_back(outputs, targets)
        if launch.meanwhile is not None:
            launch.meanwhile()
        stream.synchronize()
        self._count_replay(graph, staged - start)

    def _run_eager_on_device(
        self, launch: Launch, staging: Staging, outputs: Sequence[torch.Tensor]
    ) -> None:
        device = self._sync.device
        start = time.perf_counter()
        rows, _sources, targets = self._addresses(launch, outputs, staging)
        hidden = torch.empty(rows, launch.layer.hidden_size, dtype=self._dtype, device=device)
        gather_rows(hidden, staging.sources[:rows])
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
        scatter_rows(out.contiguous(), staging.dests[:rows])
        _copy_back(outputs, targets)
        if launch.meanwhile is not None:
            launch.meanwhile()
        torch.cuda.current_stream(device).synchronize()
        self._metrics.eager_runs.inc()
        self._metrics.stage["stage"].observe(staged - start)
        self._metrics.stage["kernel"].observe(events[0].elapsed_time(events[1]) / 1000)

    def _addresses(
        self,
        launch: Launch,
        outputs: Sequence[torch.Tensor],
        staging: Staging,
        pad_to: int = 0,
    ) -> tuple[int, list[torch.Tensor], list[torch.Tensor]]:
        """Fills ``staging``'s address tables for a device-I/O launch; returns its rows, the
        tensors its rows are gathered from and those they are scattered to (``outputs``, or
        device stand-ins of the compute dtype for ``_copy_back``). Rows move as bytes:
        tensors of another dtype, only ever a client's CUDA memory (mapped host memory is in
        the compute dtype), pass through device copies, which the caller keeps until the
        launch's synchronisation."""
        dtype = self._dtype
        sources = [p if p.dtype == dtype else p.to(dtype) for p in launch.parts]
        targets = [o if o.dtype == dtype else torch.empty_like(o, dtype=dtype) for o in outputs]
        rows = sum(int(p.shape[0]) for p in sources)
        staging.fill_addresses(sources, targets, pad_to=max(pad_to, rows))
        return rows, sources, targets

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


def _copy_back(outputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]) -> None:
    """Each output ← its stand-in of the compute dtype (``Runner._addresses``), cast on the
    device."""
    for output, target in zip(outputs, targets, strict=True):
        if output is not target:
            output.copy_(target)
