"""CUDA graphs of the whole layer forward, one per (layer, token bucket).

A graph replays its input's way in, routing, alignment, both grouped GEMMs with LoRA, the sum
and its output's way out without any Python launch cost. Its input (bucket, H), per-token slot
ids (bucket,) and output live in the cache's page-locked ``Staging``, fixed at start-up: the
graph's first kernel reads them across the bus and its last writes the output back there
(``kernels/host_copy.py``), so a launch fills the staging, replays and synchronises once.
Adapters change only device tensors that the kernels read (slot ids and the slot buffers,
allocated once at start-up and never reallocated), so one graph serves every adapter mix; rows
past a launch's tokens carry slot -1 and are ignored.

Graphs are captured lazily, on a bucket's first use, after an eager warm-up run (which also
compiles and tunes the Triton kernels outside the capture); all share one memory pool, and
the memory each takes is logged. A capture that fails is logged and the bucket runs eagerly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from executor_service.batch import KernelFn
from executor_service.staging import Staging
from kernels import LoRAContext, LoRASlots, MoELayerWeights
from kernels.host_copy import copy_bytes
from shared.logs import log_event

log = logging.getLogger(__name__)

#: Token buckets; a launch of T tokens replays the smallest bucket ≥ T.
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


@dataclass
class LayerGraph:
    """One captured forward of ``bucket`` rows of the cache's staging."""

    graph: torch.cuda.CUDAGraph
    bucket: int

    def replay(self) -> None:
        self.graph.replay()


class GraphCache:
    """Graphs of the layers of one device, captured on first use."""

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
        #: What every graph reads its input from and writes its output to.
        self.staging = Staging(hidden_size, dtype, max(buckets), growable=False)
        self._graphs: dict[tuple[int, int], LayerGraph | None] = {}
        self._pool = torch.cuda.graph_pool_handle()
        self.captured_bytes = 0

    def bucket(self, tokens: int) -> int | None:
        """The smallest bucket that holds ``tokens``; None past the largest."""
        for size in self.buckets:
            if size >= tokens:
                return size
        return None

    def get(self, layer: int, bucket: int) -> LayerGraph | None:
        """The graph of (layer, bucket), captured now if it is the first use; None if its
        capture failed (the launch runs eagerly)."""
        key = (layer, bucket)
        if key not in self._graphs:
            self._graphs[key] = self._capture(layer, bucket)
        return self._graphs[key]

    def _capture(self, layer: int, bucket: int) -> LayerGraph | None:
        weights = self._layers[layer]
        hidden = torch.empty(bucket, weights.hidden_size, dtype=self._dtype, device=self._device)
        slots = torch.empty(bucket, dtype=torch.int32, device=self._device)
        lora = LoRAContext(self._lora_slots(layer), slots)
        io = self.staging

        def forward() -> None:
            copy_bytes(hidden, io.input[:bucket])
            copy_bytes(slots, io.slots[:bucket])
            copy_bytes(io.output[:bucket], self._kernel(hidden, weights, lora, None))

        try:
            side = torch.cuda.Stream(self._device)  # type: ignore[no-untyped-call]
            side.wait_stream(torch.cuda.current_stream(self._device))
            with torch.cuda.stream(side):
                io.fill([], None, pad_to=bucket)  # no rows: every slot id -1
                for _ in range(2):  # compile, tune and allocate outside the capture
                    forward()
            torch.cuda.current_stream(self._device).wait_stream(side)
            # The capture starts by handing cached blocks back to the driver: do it first, so
            # that the difference is the graph's own memory.
            torch.cuda.synchronize(self._device)
            torch.cuda.empty_cache()
            before = torch.cuda.memory_reserved(self._device)
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
                error=str(exc),
            )
            return None
        taken = torch.cuda.memory_reserved(self._device) - before
        self.captured_bytes += taken
        log_event(
            log,
            "cuda_graph_captured",
            layer=layer,
            bucket=bucket,
            bytes=taken,
            total_bytes=self.captured_bytes,
        )
        return LayerGraph(graph=graph, bucket=bucket)
