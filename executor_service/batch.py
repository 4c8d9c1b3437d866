"""What a merged launch is made of: validated requests, their segments concatenated, and the
output split back per request.

Requests for the same layer are independent row by row (routing, experts and LoRA act on each
token alone), so several requests run as one launch whose segments are theirs one after the
other; each request's rows of the output are exactly its answer.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from executor_service.slots import Wanted
from executor_service.sources import ResolvedAdapter
from kernels import LoRAContext, MoELayerWeights, Routing

#: ``kernels.moe_forward`` with the backend bound; tests inject a wrapper (for example one that
#: slows the kernel down) through ``ForwardEngine(kernel=...)``.
KernelFn = Callable[
    [torch.Tensor, MoELayerWeights, LoRAContext | None, Routing | None], torch.Tensor
]


@dataclass(frozen=True)
class Segment:
    """``num_tokens`` consecutive tokens using ``adapter`` ("" = the base model)."""

    num_tokens: int
    adapter: str
    #: The adapter when ``adapter`` is a direct channel's handle to one it leased ("#0"):
    #: resolved when the lease was taken, not per request.
    leased: ResolvedAdapter | None = None


@dataclass(frozen=True)
class Prepared:
    """One validated Forward request with its adapters resolved and their data at hand."""

    layer: int
    #: (T, H) in the wire dtype, on the CPU (may view the message's bytes: read only) or on
    #: the GPU (a client's CUDA memory).
    hidden: torch.Tensor
    segments: tuple[Segment, ...]
    #: Per segment: its adapter version, None for the base model.
    adapters: tuple[ResolvedAdapter | None, ...]
    #: Distinct adapters (by digest) with what leasing their slots needs.
    wanted: tuple[Wanted, ...]
    #: Precomputed routing, on the CPU (checked).
    routing: Routing | None
    #: time.monotonic() after which waiting for GPU slots fails the request.
    slot_deadline: float
    #: (T, H) in the wire dtype, where the launch writes this request's answer: a fresh
    #: tensor, a view of shared memory that a front end reads, or (with ``hidden`` on the GPU)
    #: a view of the client's CUDA memory.
    output: torch.Tensor
    #: ``hidden`` and ``output`` are in page-locked host memory the device reads and writes
    #: in place (``ForwardInput.mapped``).
    mapped: bool = False
    #: Only the device may touch its tensors (``ForwardInput.gpu_only``).
    gpu_only: bool = False
    #: Client requests whose rows these are (``ForwardInput.requests``).
    requests: int = 1

    @property
    def tokens(self) -> int:
        return int(self.hidden.shape[0])

    @property
    def digests(self) -> frozenset[str]:
        return frozenset(w.adapter.digest for w in self.wanted)

    @property
    def labels(self) -> list[str]:
        """``name:VERSION`` per segment, "" for base segments."""
        return [a.label if a is not None else "" for a in self.adapters]


def batch_key(request: Prepared) -> tuple[int, bool, bool, bool]:
    """Requests merge only with others of the same key: one layer, routing given by the
    caller for all of them or for none, tensors all in host memory or all on the GPU, and
    tensors only the device may touch for all of them or for none (a mixed launch is
    staged: its rows copied by the CPU)."""
    return request.layer, request.routing is not None, request.hidden.is_cuda, request.gpu_only


def merged_wanted(requests: Sequence[Prepared]) -> list[Wanted]:
    """The distinct adapters of all ``requests``, each with data if any request has it."""
    merged: dict[str, Wanted] = {}
    for request in requests:
        for wanted in request.wanted:
            known = merged.get(wanted.adapter.digest)
            if known is None or known.packed is None:
                merged[wanted.adapter.digest] = wanted
    return list(merged.values())


def token_slots(requests: Sequence[Prepared], slots: Mapping[str, int]) -> torch.Tensor:
    """(ΣT,) int32 on the CPU: each token's slot, -1 for base tokens."""
    # numpy.repeat over per-segment lists: a few µs, where a per-token Python list costs
    # ~10 µs per 64 tokens and torch.repeat_interleave ~30 µs on small CPU tensors.
    per_segment: list[int] = []
    counts: list[int] = []
    for request in requests:
        for segment, adapter in zip(request.segments, request.adapters, strict=True):
            per_segment.append(-1 if adapter is None else slots[adapter.digest])
            counts.append(segment.num_tokens)
    return torch.from_numpy(np.repeat(np.array(per_segment, dtype=np.int32), counts))


def merged_routing(requests: Sequence[Prepared]) -> Routing | None:
    """The callers' routings concatenated (None when none gave one; see ``batch_key``)."""
    given = [r.routing for r in requests if r.routing is not None]
    if not given:
        return None
    if len(given) == 1:
        return given[0]
    return Routing(
        topk_ids=torch.cat([g.topk_ids for g in given]),
        topk_weights=torch.cat([g.topk_weights for g in given]),
    )


def slot_wait(requests: Sequence[Prepared]) -> float:
    """How long the batch may wait for slots: until the earliest request's limit."""
    return max(0.0, min(r.slot_deadline for r in requests) - time.monotonic())
