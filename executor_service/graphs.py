"""CUDA graphs of the whole layer forward, two per (layer, token bucket), all captured at
start-up.

A graph replays its input's way in, routing, alignment, both grouped GEMMs with LoRA, the sum
and its output's way out without any Python launch cost. Its input (bucket, H), per-token slot
ids (bucket,) and output live in the cache's page-locked ``Staging``, fixed at start-up: the
graph's first kernel reads them across the bus into device buffers and its last writes the
output back there (``kernels/host_copy.py``), so a launch fills the staging, replays and
synchronises once. Adapters change only device tensors that the kernels read (slot ids and the
slot buffers, allocated once at start-up and never reallocated), so one graph serves every
adapter mix; rows past a launch's tokens carry slot -1 and are ignored. The second graph of
each pair ("device I/O") is for requests whose tensors the device reaches where they lie: a
client's CUDA memory, or a front end's page-locked arena. Its first kernel gathers each row
from the address the staging's ``sources`` table gives it, its last scatters each output row
to the address in ``dests`` (``kernels.host_copy.gather_rows``): a launch writes two tables of
addresses, replays and synchronises, and no row is copied by the CPU or by a launch from
Python.

Everything a graph reads or writes outside its own memory pool must outlive it: the staging,
the slot buffers, the weights, and the device input and slot-id buffers, which the cache owns
(one pair of ``max(buckets)`` rows that every graph views a prefix of — replays never overlap,
as one thread launches them all). A graph does not keep tensors alive: a buffer made for the
capture and dropped after it goes back to the caching allocator, and the next
``empty_cache()`` unmaps it while the graph still writes there (an illegal memory access, or
another tensor's bytes overwritten).

``capture_all`` captures every graph before the executor reports SERVING, on a quiet device:
a capture empties the allocator's cache and must not race loads or replays. All graphs share
one memory pool (their intermediates; replays run one at a time). A capture that fails is
logged and its bucket runs eagerly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from executor_service.batch import KernelFn
from executor_service.staging import Staging
from kernels import LoRAContext, LoRASlots, MoELayerWeights
from kernels.host_copy import copy_bytes, gather_rows, scatter_rows
from moelora.client.logs import log_event

log = logging.getLogger(__name__)


def graph_buckets(max_batch_tokens: int) -> tuple[int, ...]:
    """The buckets that hold every merged launch: powers of two below ``max_batch_tokens``,
    then ``max_batch_tokens`` itself (a longer request runs alone, eagerly). A launch of T
    tokens replays the smallest bucket ≥ T."""
    buckets = [1 << i for i in range(max_batch_tokens.bit_length()) if 1 << i < max_batch_tokens]
    return (*buckets, max_batch_tokens)


#: The buckets at the default --max-batch-tokens.
BUCKETS = graph_buckets(512)


@dataclass
class LayerGraph:
    """One captured forward of ``bucket`` rows of the cache's staging."""

    graph: torch.cuda.CUDAGraph
    bucket: int

    def replay(self) -> None:
        self.graph.replay()


@dataclass(frozen=True)
class CaptureReport:
    """What ``capture_all`` took."""

    graphs: int
    failed: int
    seconds: float
    #: Device memory reserved by the graphs' pool.
    bytes: int


class GraphCache:
    """The graphs of the layers of one device."""

    def __init__(
        self,
        kernel: KernelFn,
        layers: Mapping[int, MoELayerWeights],
        lora_slots: Callable[[int], LoRASlots],
        device: torch.device,
        dtype: torch.dtype,
        buckets: tuple[int, ...] = BUCKETS,
    ) -> None:
        self._kernel = kernel
        self._layers = layers
        self._lora_slots = lora_slots
        self._device = device
        self._dtype = dtype
        self.buckets = buckets
        hidden_size = next(iter(layers.values())).hidden_size if layers else 0
        rows = max(buckets)
        #: What every graph reads its input from and writes its output to.
        self.staging = Staging(hidden_size, dtype, rows, growable=False)
        # The device side of the staging, read by every graph's kernels (see the module doc).
        self._hidden = torch.zeros(rows, hidden_size, dtype=dtype, device=device)
        self._slots = torch.full((rows,), -1, dtype=torch.int32, device=device)
        self._graphs: dict[tuple[int, int, bool], LayerGraph | None] = {}
        self._pool = torch.cuda.graph_pool_handle()

    def bucket(self, tokens: int) -> int | None:
        """The smallest bucket that holds ``tokens``; None past the largest."""
        for size in self.buckets:
            if size >= tokens:
                return size
        return None

    def get(self, layer: int, bucket: int, device_io: bool = False) -> LayerGraph | None:
        """The graph of (layer, bucket); None if its capture failed (the launch runs
        eagerly). KeyError before ``capture_all``. ``device_io``: the variant that gathers
        and scatters rows by the staging's address tables."""
        return self._graphs[(layer, bucket, device_io)]

    def capture_all(self) -> CaptureReport:
        """Captures the graph of every (layer, bucket); call once, before serving."""
        start = time.perf_counter()
        torch.cuda.synchronize(self._device)
        torch.cuda.empty_cache()  # so that the difference below is the graphs' own memory
        before = torch.cuda.memory_reserved(self._device)
        for layer in sorted(self._layers):
            for bucket in self.buckets:
                for device_io in (False, True):
                    self._graphs[(layer, bucket, device_io)] = self._capture(
                        layer, bucket, device_io
                    )
        torch.cuda.synchronize(self._device)
        report = CaptureReport(
            graphs=sum(g is not None for g in self._graphs.values()),
            failed=sum(g is None for g in self._graphs.values()),
            seconds=time.perf_counter() - start,
            bytes=torch.cuda.memory_reserved(self._device) - before,
        )
        log_event(
            log,
            "cuda_graphs_captured",
            graphs=report.graphs,
            failed=report.failed,
            layers=len(self._layers),
            buckets=list(self.buckets),
            seconds=round(report.seconds, 3),
            bytes=report.bytes,
        )
        return report

    def _capture(self, layer: int, bucket: int, device_io: bool) -> LayerGraph | None:
        weights = self._layers[layer]
        hidden, slots = self._hidden[:bucket], self._slots[:bucket]
        lora = LoRAContext(self._lora_slots(layer), slots)
        io = self.staging

        def forward() -> None:
            if device_io:
                gather_rows(hidden, io.sources[:bucket])
            else:
                copy_bytes(hidden, io.input[:bucket])
            copy_bytes(slots, io.slots[:bucket])
            out = self._kernel(hidden, weights, lora, None)
            if device_io:
                scatter_rows(out.contiguous(), io.dests[:bucket])
            else:
                copy_bytes(io.output[:bucket], out)

        try:
            side = torch.cuda.Stream(self._device)  # type: ignore[no-untyped-call]
            side.wait_stream(torch.cuda.current_stream(self._device))
            with torch.cuda.stream(side):
                io.fill([], None, pad_to=bucket)  # no rows: every slot id -1
                for _ in range(2):  # compile, tune and allocate outside the capture
                    forward()
            torch.cuda.current_stream(self._device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                forward()
        except Exception as exc:  # a kernel that cannot be captured still serves eagerly
            log_event(
                log,
                "cuda_graph_capture_failed",
                logging.WARNING,
                layer=layer,
                bucket=bucket,
                device_io=device_io,
                error=str(exc),
            )
            return None
        return LayerGraph(graph=graph, bucket=bucket)
