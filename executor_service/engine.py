"""Where Forward is computed: validate, resolve segments to slots, run the MoE kernel.

``ForwardEngine.forward`` takes decoded tensors (the gRPC layer decodes and encodes) and
raises the domain errors that the servicer maps to status codes. Every check on the request
happens here, before anything touches the device, so that a bad request never reaches the
kernel and leaves nothing behind.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from executor_service.adapters import AdapterManager
from executor_service.metrics import ExecutorMetrics
from executor_service.model_loader import BaseModel
from kernels import LoRAContext, MoELayerWeights, Routing
from shared.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from shared.layer_set import format_layers
from shared.refs import AdapterRef

#: ``kernels.moe_forward`` with the backend bound; tests inject a wrapper (for example one that
#: slows the kernel down) through ``ForwardEngine(kernel=...)``.
KernelFn = Callable[
    [torch.Tensor, MoELayerWeights, LoRAContext | None, Routing | None], torch.Tensor
]

WIRE_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ROUTING_ID_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class Segment:
    """``num_tokens`` consecutive tokens using ``adapter`` ("" = the base model)."""

    num_tokens: int
    adapter: str


@dataclass(frozen=True)
class ForwardInput:
    """One Forward request, decoded. Tensors may be read-only views of the message."""

    layer: int
    hidden: torch.Tensor
    segments: Sequence[Segment]
    topk_ids: torch.Tensor | None = None
    topk_weights: torch.Tensor | None = None


@dataclass(frozen=True)
class ForwardOutput:
    """(T, H) on the CPU in the input's dtype, and ``name:VERSION`` per segment ("" = base)."""

    output: torch.Tensor
    resolved_adapters: list[str]
    #: Adapters this request loaded into GPU slots (0: all were resident, or none used).
    adapters_loaded: int = 0


@dataclass(frozen=True)
class EngineSettings:
    """Where the engine computes, in what, and the largest T it takes."""

    device: torch.device
    dtype: torch.dtype
    max_tokens_per_request: int


class ForwardEngine:
    """Computes MoE layers of one base model for batches that mix adapters."""

    def __init__(
        self,
        model: BaseModel,
        adapters: AdapterManager,
        settings: EngineSettings,
        kernel: KernelFn,
        metrics: ExecutorMetrics,
    ) -> None:
        self.model = model
        self.adapters = adapters
        self.settings = settings
        self._kernel = kernel
        self._metrics = metrics

    def forward(self, request: ForwardInput, slot_wait: float) -> ForwardOutput:
        """Runs one request, waiting up to ``slot_wait`` seconds for GPU slots that requests
        in flight hold."""
        start = time.perf_counter()
        layer = self._layer(request.layer)
        hidden = request.hidden
        tokens = self._check_hidden(hidden)
        segments = _checked_segments(request.segments, tokens)
        routing = self._routing(request, tokens, layer)
        refs = {
            s.adapter: AdapterRef.parse(s.adapter, f"segments[{i}].adapter")
            for i, s in enumerate(segments)
            if s.adapter
        }
        resolved = {text: self.adapters.resolve(ref) for text, ref in refs.items()}
        distinct = list({a.digest: a for a in resolved.values()}.values())
        device, dtype = self.settings.device, self.settings.dtype
        buffers = self.adapters.slots.buffers
        lease = self.adapters.acquire(distinct, slot_wait) if distinct else None
        try:
            with buffers.sync.on_device():
                x = hidden.to(device=device, dtype=dtype)
                lora = None
                if lease is not None:
                    per_segment = [
                        lease.slots[resolved[s.adapter].digest] if s.adapter else -1
                        for s in segments
                    ]
                    token_slots = torch.repeat_interleave(
                        torch.tensor(per_segment, dtype=torch.int32),
                        torch.tensor([s.num_tokens for s in segments]),
                    ).to(device)
                    buffers.sync.wait(lease.ready)
                    lora = LoRAContext(buffers.layer(request.layer), token_slots)
                out = self._kernel(x, layer, lora, routing)
        finally:
            # Released once the kernel is enqueued: on CUDA the recorded event, not the host,
            # keeps a rewrite of these slots behind the kernel.
            if lease is not None:
                self.adapters.release(lease, buffers.sync.record())
        output = out.to(device="cpu", dtype=hidden.dtype)
        lora_tokens = sum(s.num_tokens for s in segments if s.adapter)
        self._metrics.forward_tokens.labels("lora").inc(lora_tokens)
        self._metrics.forward_tokens.labels("base").inc(tokens - lora_tokens)
        self._metrics.forward_seconds.observe(time.perf_counter() - start)
        return ForwardOutput(
            output=output,
            resolved_adapters=[resolved[s.adapter].label if s.adapter else "" for s in segments],
            adapters_loaded=0 if lease is None else len(lease.loaded),
        )

    def _layer(self, index: int) -> MoELayerWeights:
        layer = self.model.layers.get(index)
        if layer is not None:
            return layer
        served = format_layers(self.model.layers)
        if index in self.model.spec.moe_layers:
            # A cluster client sent a layer to the wrong group: say where this one stands.
            raise FailedPrecondition(
                f"layer: {index} is a MoE layer of base model {self.model.name} that this "
                f"executor does not serve; it serves layers {served} (--layers)",
                "layer",
            )
        raise InvalidArgument(
            f"layer: {index} is not a MoE layer of base model {self.model.name}; "
            f"its MoE layers are {format_layers(self.model.spec.moe_layers)}",
            "layer",
        )

    def _check_hidden(self, hidden: torch.Tensor) -> int:
        if hidden.dtype not in WIRE_FLOAT_DTYPES:
            raise InvalidArgument(
                f"hidden_states.dtype: {_name(hidden.dtype)} is not float32, float16 or bfloat16",
                "hidden_states.dtype",
            )
        size = self.model.spec.hidden_size
        if hidden.dim() != 2 or hidden.shape[1] != size:
            raise InvalidArgument(
                f"hidden_states.shape: {list(hidden.shape)} is not [T, {size}] "
                f"(hidden_size of {self.model.name})",
                "hidden_states.shape",
            )
        tokens = int(hidden.shape[0])
        if tokens < 1:
            raise InvalidArgument("hidden_states.shape: T must be at least 1", "hidden_states")
        limit = self.settings.max_tokens_per_request
        if tokens > limit:
            raise ResourceExhausted(
                f"hidden_states: {tokens} tokens exceed max_tokens_per_request={limit}; "
                "split the request",
                "hidden_states",
            )
        return tokens

    def _routing(
        self, request: ForwardInput, tokens: int, layer: MoELayerWeights
    ) -> Routing | None:
        ids, weights = request.topk_ids, request.topk_weights
        if ids is None and weights is None:
            return None
        if ids is None or weights is None:
            missing = "routing.topk_ids" if ids is None else "routing.topk_weights"
            raise InvalidArgument(
                f"{missing}: routing needs both topk_ids and topk_weights", missing
            )
        k = layer.router.top_k
        for field, tensor in (("routing.topk_ids", ids), ("routing.topk_weights", weights)):
            if tuple(tensor.shape) != (tokens, k):
                raise InvalidArgument(
                    f"{field}.shape: {list(tensor.shape)} is not [T, top_k] = [{tokens}, {k}]",
                    f"{field}.shape",
                )
        if ids.dtype not in ROUTING_ID_DTYPES:
            raise InvalidArgument(
                f"routing.topk_ids.dtype: {_name(ids.dtype)} is not int32 or int64",
                "routing.topk_ids.dtype",
            )
        if weights.dtype != torch.float32:
            raise InvalidArgument(
                f"routing.topk_weights.dtype: {_name(weights.dtype)} is not float32",
                "routing.topk_weights.dtype",
            )
        experts = layer.num_experts
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= experts:
            raise InvalidArgument(
                f"routing.topk_ids: expert ids must lie in [0, {experts}), got [{low}, {high}]",
                "routing.topk_ids",
            )
        if not bool(torch.isfinite(weights).all()):
            raise InvalidArgument(
                "routing.topk_weights: weights must be finite", "routing.topk_weights"
            )
        device = self.settings.device
        return Routing(
            topk_ids=ids.to(device=device, dtype=torch.int32),
            topk_weights=weights.to(device=device).contiguous(),
        )


def _checked_segments(segments: Sequence[Segment], tokens: int) -> list[Segment]:
    if not segments:
        return [Segment(tokens, "")]
    for i, segment in enumerate(segments):
        if segment.num_tokens < 1:
            raise InvalidArgument(
                f"segments[{i}].num_tokens: must be at least 1", f"segments[{i}].num_tokens"
            )
    total = sum(s.num_tokens for s in segments)
    if total != tokens:
        raise InvalidArgument(
            f"segments: num_tokens sum to {total}, but hidden_states has T={tokens}", "segments"
        )
    return list(segments)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
