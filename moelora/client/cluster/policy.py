"""Which replica of a layer group serves an adapter: rendezvous hashing with bounded loads.

Plain rendezvous (highest-random-weight) hashing ranks a group's replicas per adapter by
``hash(adapter, replica)``: each adapter's traffic goes to one replica, and a replica joining
or leaving moves only its share of adapters. With few adapters per replica its split is lumpy
(12 adapters over 2 replicas may fall 10/2), and a replica holding more adapters than slots
churns while another leaves slots idle. So the first replica an adapter is *assigned* to is
the highest-ranked one still under ``ceil(balance · adapters / replicas)`` assignments
(consistent hashing with bounded loads, Mirrokni et al. 2018); the assignment then sticks for
as long as that replica stays healthy. Spills (overload, draining, failure) walk the rest of
the rendezvous order and do not move the assignment.

With ``balance = 1`` and uniform traffic every replica holds the same number of adapters, and
slots are used evenly: no routing can then load fewer adapters per request, because at most
``replicas · slots`` distinct adapters are resident at any time.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter, OrderedDict
from collections.abc import Sequence


def score(key: str, replica: str) -> int:
    """The rendezvous weight of ``replica`` for ``key`` (stable across processes)."""
    digest = hashlib.blake2b(f"{key}\0{replica}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rendezvous(key: str, replicas: Sequence[str]) -> list[str]:
    """``replicas`` ordered by descending weight for ``key``."""
    return sorted(replicas, key=lambda replica: score(key, replica), reverse=True)


class AffinityTable:
    """Adapter → replica assignments of one layer group, bounded in load and in size (the
    least recently used assignments are forgotten beyond ``capacity``)."""

    def __init__(self, balance: float = 1.0, capacity: int = 4096) -> None:
        if balance < 1.0:
            raise ValueError("balance must be at least 1.0")
        self._balance = balance
        self._capacity = capacity
        self._assigned: OrderedDict[str, str] = OrderedDict()

    def rank(self, adapter: str, replicas: Sequence[str]) -> list[str]:
        """``replicas`` in the order to try for ``adapter``: its assigned replica first."""
        order = rendezvous(adapter, replicas)
        if not order:
            return order
        first = self._assigned.get(adapter)
        if first not in order:
            first = self._assign(adapter, order)
        self._assigned.move_to_end(adapter)
        return [first, *(r for r in order if r != first)]

    def assignment(self, adapter: str) -> str | None:
        return self._assigned.get(adapter)

    def _assign(self, adapter: str, order: list[str]) -> str:
        live = set(order)
        loads = Counter(r for a, r in self._assigned.items() if r in live and a != adapter)
        cap = math.ceil(self._balance * (sum(loads.values()) + 1) / len(order))
        first = next((r for r in order if loads[r] < cap), order[0])
        self._assigned[adapter] = first
        while len(self._assigned) > self._capacity:
            self._assigned.popitem(last=False)
        return first


def batch_key(segments: Sequence[tuple[int, str | None]] | None) -> str | None:
    """The adapter a batch is routed by: the one with the most tokens (ties: the first in
    name order); None for a batch on the base model alone."""
    tokens: Counter[str] = Counter()
    for count, adapter in segments or ():
        if adapter:
            tokens[adapter] += count
    if not tokens:
        return None
    return min(tokens, key=lambda adapter: (-tokens[adapter], adapter))
