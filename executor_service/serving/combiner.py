"""A front end's Forward requests, combined while they wait: one descriptor for several.

The engine's launch loop spends its Python per descriptor (decode, checks, adapter lookups,
slot lease, answer), and under many clients that, not the GPU, bounds an executor. So a front
end sends a request on at once while it has fewer than ``combine_after`` descriptors queued in
the engine (sent and not answered, less those the engine said wait for adapter loads, which
take milliseconds); past that, requests wait, and the next free turn sends every waiting
request that can share a launch as *one* descriptor: their rows copied one after the other
into the front end's arena, their segments concatenated (requests are independent row by row,
so each one's rows of the answer are exactly its answer). No timer: an idle front end adds no
wait; a busy one sends fewer, larger descriptors.

A combined descriptor fails as a whole. The engine's own state (not serving, overloaded) is
every member's answer; any other error sends each member again alone, so a request's error is
always its own (never a neighbour's field) and costs the others one more round trip.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from executor_service.config import ExecutorSettings
from executor_service.serving.arena import Arena, ArenaFull, Region
from executor_service.serving.engine_link import EngineLink
from moelora.client.engine_wire import ForwardDescriptor, ForwardResult, TensorRef

_UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]
_RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]


@dataclass(frozen=True)
class CombineLimits:
    """What one combined descriptor may hold."""

    #: Descriptors of a front end in the engine at once before requests wait to combine
    #: (0: never combine).
    combine_after: int
    #: Rows of one combined descriptor (the engine's per-request and per-launch caps).
    max_tokens: int
    #: Distinct adapter references of one combined descriptor (so that it fits the slots).
    max_adapters: int


def combine_limits(settings: ExecutorSettings) -> CombineLimits:
    """The executor's limits: a combined descriptor is one request to the engine and one
    launch's worth of rows, with adapters for half the slots (others' requests merge too)."""
    return CombineLimits(
        combine_after=settings.frontend_combine_after,
        max_tokens=min(settings.max_tokens_per_request, settings.max_batch_tokens),
        max_adapters=max(1, settings.num_slots // 2),
    )


class _Member:
    """A request waiting its turn, then its answer (or that it must go alone)."""

    __slots__ = ("adapters", "alone", "answered", "descriptor", "error", "key", "result", "tokens")

    def __init__(self, descriptor: ForwardDescriptor) -> None:
        self.descriptor = descriptor
        self.tokens = descriptor.hidden.shape[0]
        self.key = _key(descriptor)
        self.adapters = frozenset(a for _, a in descriptor.segments if a)
        self.answered = False
        self.alone = False
        self.result: ForwardResult | None = None
        self.error: BaseException | None = None


class Combiner:
    """Sends a front end's Forward descriptors to the engine, combining those that wait (see
    the module doc). Thread-safe: every handler thread calls ``forward``."""

    def __init__(self, link: EngineLink, limits: CombineLimits) -> None:
        self._link = link
        self._arena: Arena = link.arena
        self._limits = limits
        self._cond = threading.Condition()
        self._waiting: list[_Member] = []
        #: Request ids of this front end's descriptors queued in the engine: sent, not yet
        #: answered, not waiting for adapter loads (``EngineLink.listen_waiting``).
        self._queued: set[int] = set()
        link.listen_waiting(self._loading)

    def _loading(self, request_id: int) -> None:
        """A descriptor waits for its adapters, not for the launch loop: requests behind it
        need not wait for it (a load takes milliseconds)."""
        with self._cond:
            if request_id in self._queued:
                self._queued.discard(request_id)
                self._cond.notify_all()

    def forward(self, descriptor: ForwardDescriptor) -> ForwardResult:
        """``EngineLink.forward``'s answer for ``descriptor``, which may travel combined."""
        if self._limits.combine_after <= 0 or not combinable(descriptor):
            return self._link.forward(descriptor)
        member = _Member(descriptor)
        with self._cond:
            self._waiting.append(member)
            while not member.answered:
                if len(self._queued) >= self._limits.combine_after or not self._waiting:
                    self._cond.wait()
                    continue
                group = self._take()
                request_id = group[0].descriptor.request_id
                if len(group) > 1:
                    request_id = self._link.next_id()
                self._queued.add(request_id)
                self._cond.release()
                try:
                    answers = self._send(group, request_id)
                except BaseException as exc:  # the link's Unavailable: everyone's answer
                    answers = [(None, exc, False)] * len(group)
                finally:
                    self._cond.acquire()
                    self._queued.discard(request_id)
                for waiting, (result, error, alone) in zip(group, answers, strict=True):
                    waiting.result, waiting.error, waiting.alone = result, error, alone
                    waiting.answered = True
                self._cond.notify_all()
        if member.alone:
            return self._link.forward(descriptor)
        if member.error is not None:
            raise member.error
        assert member.result is not None
        return member.result

    def _take(self) -> list[_Member]:
        """The waiting requests that go next as one descriptor: the first, and those after it
        that can share its launch within the limits (lock held; ``_waiting`` not empty)."""
        head = self._waiting[0]
        group, tokens, adapters = [head], head.tokens, head.adapters
        for member in self._waiting[1:]:
            if member.key != head.key:
                continue
            if tokens + member.tokens > self._limits.max_tokens:
                continue
            joined = adapters | member.adapters
            if len(joined) > self._limits.max_adapters:
                continue
            group.append(member)
            tokens += member.tokens
            adapters = joined
        taken = {id(m) for m in group}
        self._waiting = [m for m in self._waiting if id(m) not in taken]
        return group

    def _send(
        self, group: list[_Member], request_id: int
    ) -> list[tuple[ForwardResult | None, BaseException | None, bool]]:
        """Each member's (result, error, go alone), the group sent as one descriptor
        (``request_id``: a combined one's)."""
        if len(group) == 1:
            return [(self._link.forward(group[0].descriptor), None, False)]
        descriptors = [m.descriptor for m in group]
        regions: list[Region] = []
        try:
            try:
                combined = self._combined(descriptors, request_id, regions)
            except ArenaFull:  # no room to combine now: each as it came
                return [(None, None, True)] * len(group)
            result = self._link.forward(combined)
            if result.code == 0:
                return [(r, None, False) for r in self._split(descriptors, combined, result)]
            if result.code == _UNAVAILABLE or (
                result.code == _RESOURCE_EXHAUSTED and result.retry_after_ms > 0
            ):  # the engine's state, not a member's fault: the same for all
                return [
                    (dataclasses.replace(result, request_id=d.request_id), None, False)
                    for d in descriptors
                ]
            return [(None, None, True)] * len(group)
        finally:
            for region in regions:
                self._arena.free(region)

    def _combined(
        self, descriptors: Sequence[ForwardDescriptor], request_id: int, regions: list[Region]
    ) -> ForwardDescriptor:
        """One descriptor for all of ``descriptors``: their tensors copied one after the other
        into new arena regions (``regions``), their segments concatenated."""
        first = descriptors[0]
        hidden = self._concatenated([d.hidden for d in descriptors], regions)
        output = self._reserved(first.output, hidden, regions)
        ids = weights = None
        if first.topk_ids is not None:  # then every member has routing (``_key``)
            ids = self._concatenated([r for d in descriptors if (r := d.topk_ids)], regions)
            weights = self._concatenated([r for d in descriptors if (r := d.topk_weights)], regions)
        return ForwardDescriptor(
            request_id=request_id,
            layer=first.layer,
            slot_wait=min(d.slot_wait for d in descriptors),
            decode_seconds=max(d.decode_seconds for d in descriptors),
            scope=first.scope,
            hidden=hidden,
            output=output,
            segments=tuple(s for d in descriptors for s in _segments(d)),
            topk_ids=ids,
            topk_weights=weights,
            requests=sum(d.requests for d in descriptors),
        )

    def _concatenated(self, refs: Sequence[TensorRef], regions: list[Region]) -> TensorRef:
        nbytes = sum(r.nbytes for r in refs)
        region = self._arena.allocate(nbytes)
        regions.append(region)
        buffer = self._arena.segment.buffer
        at = region.offset
        for ref in refs:
            buffer[at : at + ref.nbytes] = buffer[ref.offset : ref.offset + ref.nbytes]
            at += ref.nbytes
        rows = sum(r.shape[0] for r in refs)
        first = refs[0]
        return TensorRef("", region.offset, nbytes, first.dtype, (rows, *first.shape[1:]))

    def _reserved(self, like: TensorRef, hidden: TensorRef, regions: list[Region]) -> TensorRef:
        region = self._arena.allocate(hidden.nbytes)
        regions.append(region)
        return TensorRef("", region.offset, hidden.nbytes, like.dtype, hidden.shape)

    def _split(
        self,
        descriptors: Sequence[ForwardDescriptor],
        combined: ForwardDescriptor,
        result: ForwardResult,
    ) -> list[ForwardResult]:
        """Each member's answer: its rows of the combined output copied to its own output
        region, its segments' adapters, and which of them the launch loaded."""
        buffer = self._arena.segment.buffer
        at = combined.output.offset
        labels = iter(result.resolved_adapters)
        loaded = set(result.loaded_adapters)
        answers = []
        for d in descriptors:
            out, n = d.output.offset, d.output.nbytes
            buffer[out : out + n] = buffer[at : at + n]
            at += n
            mine = tuple(next(labels) for _ in _segments(d))
            answers.append(
                ForwardResult(
                    d.request_id,
                    0,
                    resolved_adapters=mine,
                    adapters_loaded=len({a for a in mine if a} & loaded),
                    loaded_adapters=tuple(sorted({a for a in mine if a} & loaded)),
                    server_time_us=result.server_time_us,
                )
            )
        return answers


def combinable(descriptor: ForwardDescriptor) -> bool:
    """Whether ``descriptor`` may share a combined descriptor: its tensors in the front end's
    arena, one request, hidden [T, H] with T >= 1, segments that cover exactly its rows, and
    routing (if any) [T, k]. Anything else goes alone, for the engine to judge."""
    d = descriptor
    if d.requests != 1 or d.hidden.segment or d.output.segment or len(d.hidden.shape) != 2:
        return False
    tokens = d.hidden.shape[0]
    if tokens < 1 or d.output.shape != d.hidden.shape or d.output.dtype != d.hidden.dtype:
        return False
    if d.segments and (
        any(n < 1 for n, _ in d.segments) or sum(n for n, _ in d.segments) != tokens
    ):
        return False
    for ref in (d.topk_ids, d.topk_weights):
        if ref is not None and (ref.segment or len(ref.shape) != 2 or ref.shape[0] != tokens):
            return False
    return (d.topk_ids is None) == (d.topk_weights is None)


def _key(d: ForwardDescriptor) -> tuple[object, ...]:
    """Descriptors combine only with their like: one layer, one dtype and width of rows, and
    routing given for all (of one layout) or for none."""
    routing = None
    if d.topk_ids is not None and d.topk_weights is not None:
        ids, weights = d.topk_ids, d.topk_weights
        routing = (ids.dtype, ids.shape[1], weights.dtype, weights.shape[1])
    return d.layer, d.hidden.dtype, d.hidden.shape[1], routing


def _segments(d: ForwardDescriptor) -> tuple[tuple[int, str], ...]:
    """The descriptor's segments, "all rows on the base model" spelled out."""
    return d.segments or ((d.hidden.shape[0], ""),)
