"""Where Forward is computed: validate and resolve a request, then run merged launches.

``ForwardEngine.prepare`` takes a decoded request (the gRPC layer decodes), checks it, resolves
its adapters and brings their data to the host, raising the domain errors that the servicer
maps to status codes: a bad request, or one whose adapter fails to load, fails alone, before
it meets other requests or the device. ``ForwardEngine.run`` computes a batch of prepared
requests for one layer as one launch (the scheduler decides which) and writes each answer
where its request said (``Prepared.output``), before the next launch reuses the staging.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from executor_service.adapters import AdapterManager
from executor_service.batch import (
    Prepared,
    Segment,
    merged_routing,
    merged_wanted,
    slot_wait,
    token_slots,
)
from executor_service.metrics import ExecutorMetrics
from executor_service.model_loader import BaseModel
from executor_service.runner import Launch, Runner
from executor_service.slots import Wanted
from executor_service.sources import ResolvedAdapter
from kernels import MoELayerWeights, Routing
from moelora.client.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from moelora.client.layer_set import format_layers
from shared.refs import AdapterRef

WIRE_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: Parsed adapter references the engine keeps (see ``ForwardEngine._ref``).
MAX_REMEMBERED_REFS = 4096
ROUTING_ID_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class ForwardInput:
    """One Forward request, decoded. Tensors may be read-only views of the message."""

    layer: int
    hidden: torch.Tensor
    segments: Sequence[Segment]
    topk_ids: torch.Tensor | None = None
    topk_weights: torch.Tensor | None = None
    #: (T, H) in hidden's dtype, where the answer goes; None: a new tensor.
    output: torch.Tensor | None = None
    #: ``hidden`` and ``output`` lie in page-locked host memory that the device reads and
    #: writes in place (a front end's pinned arena, a client's pinned shared-memory region):
    #: no copy through staging.
    mapped: bool = False
    #: Only the device may touch ``hidden`` and ``output``: a client's shared memory, which
    #: its owner may shrink under a CPU read (SIGBUS). Such requests merge only with their
    #: like (``batch.batch_key``), so their launch is never staged.
    gpu_only: bool = False
    #: Client requests whose rows these are (a front end's combined descriptor).
    requests: int = 1


@dataclass(frozen=True)
class ForwardOutput:
    """What a request learns besides its answer (written to ``Prepared.output``):
    ``name:VERSION`` per segment ("" = base)."""

    resolved_adapters: list[str]
    #: Adapters of this request that its batch loaded into GPU slots (0: all were resident).
    adapters_loaded: int = 0
    #: Their ``name:VERSION`` labels.
    loaded_adapters: tuple[str, ...] = ()


@dataclass(frozen=True)
class EngineSettings:
    """The largest T a request may carry."""

    max_tokens_per_request: int


class ForwardEngine:
    """Computes MoE layers of one base model for batches that mix adapters."""

    def __init__(
        self,
        model: BaseModel,
        adapters: AdapterManager,
        settings: EngineSettings,
        runner: Runner,
        metrics: ExecutorMetrics,
    ) -> None:
        self.model = model
        self.adapters = adapters
        self.settings = settings
        self._runner = runner
        self._metrics = metrics
        #: References parsed before, by their text (clients repeat a handful of them).
        self._refs: dict[str, AdapterRef] = {}

    def prepare(self, request: ForwardInput, slot_wait: float) -> Prepared:
        """Checks the request, resolves its adapters and brings their data to the host
        (which may wait on the adapter source); the launch may then wait up to
        ``slot_wait`` seconds for GPU slots that other requests hold."""
        prepared = self._prepare(request, slot_wait, at_once=False)
        assert prepared is not None
        return prepared

    def prepare_at_once(self, request: ForwardInput, slot_wait: float) -> Prepared | None:
        """``prepare``'s answer if it needs no waiting (adapters known to the source without
        asking, their data in a slot or the host cache), else None. A bad request raises
        here as in ``prepare``."""
        return self._prepare(request, slot_wait, at_once=True)

    def _prepare(self, request: ForwardInput, slot_wait: float, at_once: bool) -> Prepared | None:
        layer = self._layer(request.layer)
        hidden = request.hidden
        tokens = self._check_hidden(hidden)
        segments = _checked_segments(request.segments, tokens)
        routing = self._routing(request, tokens, layer)
        resolved: dict[str, ResolvedAdapter] = {}
        for i, segment in enumerate(segments):
            text = segment.adapter
            if not text or text in resolved:
                continue
            if segment.leased is not None:  # a channel's handle: resolved at its lease
                resolved[text] = segment.leased
                continue
            ref = self._ref(text, f"segments[{i}].adapter")
            adapter = self.adapters.resolve_at_once(ref) if at_once else self.adapters.resolve(ref)
            if adapter is None:
                return None
            resolved[text] = adapter
        distinct = list({a.digest: a for a in resolved.values()}.values())
        wanted: list[Wanted] | None = []
        if distinct:
            if at_once:
                wanted = self.adapters.prepare_at_once(distinct)
            else:
                wanted = self.adapters.prepare(distinct)
        if wanted is None:
            return None
        return Prepared(
            layer=request.layer,
            hidden=hidden,
            segments=tuple(segments),
            adapters=tuple(resolved[s.adapter] if s.adapter else None for s in segments),
            wanted=tuple(wanted),
            routing=routing,
            slot_deadline=time.monotonic() + slot_wait,
            output=self._output(request, tokens),
            mapped=request.mapped,
            gpu_only=request.gpu_only,
            requests=request.requests,
        )

    def _ref(self, text: str, field: str) -> AdapterRef:
        """``AdapterRef.parse(text, field)``, remembered (up to ``MAX_REMEMBERED_REFS``: any
        client may send any number of distinct ones)."""
        ref = self._refs.get(text)
        if ref is None:
            ref = AdapterRef.parse(text, field)
            if len(self._refs) >= MAX_REMEMBERED_REFS:
                self._refs.clear()
            self._refs[text] = ref
        return ref

    def _output(self, request: ForwardInput, tokens: int) -> torch.Tensor:
        shape = (tokens, self.model.spec.hidden_size)
        given = request.output
        if given is None:
            return torch.empty(shape, dtype=request.hidden.dtype)
        if tuple(given.shape) != shape or given.dtype != request.hidden.dtype:
            raise InvalidArgument(
                f"output: {list(given.shape)} {_name(given.dtype)} is not {list(shape)} "
                f"{_name(request.hidden.dtype)} (the input's shape and dtype)",
                "output",
            )
        return given

    def run(
        self, requests: Sequence[Prepared], meanwhile: Callable[[], None] | None = None
    ) -> list[ForwardOutput]:
        """Computes ``requests`` (same layer, see ``batch.batch_key``) as one launch; on a GPU
        ``meanwhile`` runs while the device computes (``Launch.meanwhile``)."""
        start = time.perf_counter()
        index = requests[0].layer
        layer = self.model.layers[index]
        wanted = merged_wanted(requests)
        with self.adapters.lease(wanted, slot_wait(requests)) as lease:
            slots = None
            if any(a is not None for r in requests for a in r.adapters):
                slots = token_slots(requests, lease.slots)
            on_device = requests[0].hidden.is_cuda  # all or none: batch.batch_key
            mapped = not on_device and all(r.mapped for r in requests)
            launch = Launch(
                layer_index=index,
                layer=layer,
                parts=[r.hidden for r in requests],
                token_slots=slots,
                lora_slots=self.adapters.lora_slots(index),
                routing=merged_routing(requests),
                meanwhile=meanwhile,
                outputs=[r.output for r in requests] if on_device or mapped else None,
            )
            out = self._runner.run(launch)
        encoding = time.perf_counter()
        if out is not None:  # else the runner wrote them before its synchronisation
            # One torch call for all requests (see Staging.fill); casts to the wire dtype.
            rows = torch.split(out, [r.tokens for r in requests])
            torch._foreach_copy_([r.output for r in requests], list(rows))
        loaded = {adapter.digest for adapter in lease.loaded}
        outputs = [_output(r, loaded) for r in requests]
        end = time.perf_counter()
        metrics = self._metrics
        metrics.stage["encode"].observe(end - encoding)
        tokens = sum(r.tokens for r in requests)
        lora_tokens = sum(
            s.num_tokens
            for r in requests
            for s, a in zip(r.segments, r.adapters, strict=True)
            if a is not None
        )
        metrics.lora_tokens.inc(lora_tokens)
        metrics.base_tokens.inc(tokens - lora_tokens)
        metrics.forward_seconds.observe(end - start)
        metrics.batch_requests.observe(sum(r.requests for r in requests))
        metrics.batch_tokens.observe(tokens)
        return outputs

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
        return Routing(
            topk_ids=ids.to(dtype=torch.int32).contiguous(),
            topk_weights=weights.contiguous(),
        )


def _output(request: Prepared, loaded: set[str]) -> ForwardOutput:
    """What ``request`` learns of its launch, ``loaded`` the digests the launch loaded."""
    if not loaded:  # the common case: every adapter was resident
        return ForwardOutput(resolved_adapters=request.labels)
    mine = {a.digest: a.label for a in request.adapters if a is not None and a.digest in loaded}
    return ForwardOutput(
        resolved_adapters=request.labels,
        adapters_loaded=len(mine),
        loaded_adapters=tuple(sorted(mine.values())),
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
