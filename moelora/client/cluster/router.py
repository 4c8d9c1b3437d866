"""What both cluster clients share, without I/O: the replicas known, which to try for a
request and in what order, what a failure means, and the counters.

A request for layer L goes to the replicas that serve L. Among them (normally one group, the
replicas of one StatefulSet) the order comes from ``policy.AffinityTable`` by the batch's main
adapter, or least-in-flight first for a base-only batch. Then, keeping that order otherwise:
replicas at ``max_in_flight`` move behind the others (a spill), and replicas that answered
UNAVAILABLE (or CANCELLED: a server that stopped) in the last ``eject_seconds`` move to the end
(tried only when nothing else is left).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from moelora.client.cluster.endpoints import Resolver, resolve_endpoints
from moelora.client.cluster.policy import AffinityTable, batch_key
from moelora.client.errors import MoeLoraError, Unavailable
from moelora.client.executor import ForwardResult
from moelora.client.layer_set import format_layers
from moelora.client.logs import log_event
from moelora.v1 import executor_pb2

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

Segments = Sequence[tuple[int, str | None]]

#: Answers that mean the replica, not the request, failed: UNAVAILABLE, and CANCELLED, which a
#: caller of these clients never causes itself (they end calls by deadline) but gets when the
#: replica's server stops with the call still queued (an executor killed or its front end
#: exiting after its engine died).
_REPLICA_GONE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


@dataclass(frozen=True)
class ClusterSettings:
    """How a cluster client routes, fails over and refreshes."""

    #: Default deadline of each call, failovers included, in seconds.
    timeout: float = 30.0
    #: How often DNS names are re-resolved and replicas not yet described are retried.
    refresh_seconds: float = 5.0
    #: After UNAVAILABLE, how long a replica is tried only when no other is left.
    eject_seconds: float = 2.0
    #: Requests in flight to one replica above which new ones spill to the next.
    max_in_flight: int = 32
    #: Bounded-load factor of the affinity table (1.0: adapters spread evenly).
    balance: float = 1.0
    #: Deadline of GetExecutorInfo when a replica appears.
    info_timeout: float = 5.0
    #: Largest gRPC message, both ways.
    max_message_bytes: int = 512 * 1024 * 1024


@dataclass
class ClusterStats:
    """Counters of one client since it started."""

    #: Forward calls answered.
    requests: int = 0
    #: Answered calls with adapters that found all of them already in GPU slots …
    hits: int = 0
    #: … and those that had to load at least one.
    misses: int = 0
    #: Adapters loaded into slots for this client's calls, all replicas together.
    adapters_loaded: int = 0
    #: Calls sent past their first-choice replica because it was busy (in flight, or
    #: RESOURCE_EXHAUSTED).
    spills: int = 0
    #: Attempts that failed with UNAVAILABLE and moved on to another replica.
    failovers: int = 0


@dataclass
class Replica:
    """One executor as the client knows it."""

    address: str
    name: str
    layers: tuple[int, ...]
    in_flight: int = 0
    down_until: float = 0.0


class Router:
    """Thread-safe state of a cluster client over ``endpoints`` (see ``endpoints.py``)."""

    def __init__(
        self, settings: ClusterSettings, endpoints: Sequence[str], resolver: Resolver
    ) -> None:
        self.settings = settings
        self._endpoints = list(endpoints)
        self._resolver = resolver
        self._lock = threading.Lock()
        self._replicas: dict[str, Replica] = {}
        self._tables: dict[tuple[int, ...], AffinityTable] = {}
        self._fingerprint: str | None = None
        self._stats = ClusterStats()

    # -- membership ----------------------------------------------------------------------

    def resolve(self) -> set[str]:
        """The endpoints' addresses now (blocking: DNS)."""
        return set(resolve_endpoints(self._endpoints, self._resolver))

    def update(self, addresses: set[str]) -> tuple[list[str], list[str]]:
        """Forgets replicas not in ``addresses``; returns (those forgotten, the addresses
        still to describe with GetExecutorInfo and ``add``)."""
        with self._lock:
            gone = sorted(set(self._replicas) - addresses)
            for address in gone:
                del self._replicas[address]
            if not self._replicas:
                self._fingerprint = None
            new = sorted(addresses - set(self._replicas))
        for address in gone:
            log_event(log, "cluster_replica_removed", address=address)
        return gone, new

    def add(self, address: str, info: executor_pb2.GetExecutorInfoResponse) -> None:
        """Registers a described replica, unless it serves another base model than the
        replicas already known (then it is logged and left out)."""
        fingerprint = info.base_model.fingerprint
        layers = tuple(info.served_layers) or tuple(info.base_model.moe_layers)
        with self._lock:
            other = self._fingerprint is not None and fingerprint != self._fingerprint
            if not other:
                self._fingerprint = fingerprint
                name = info.replica_name or address
                self._replicas[address] = Replica(address, name, layers)
        if other:
            self.pending(address, f"serves another base model ({fingerprint})")
            return
        log_event(
            log,
            "cluster_replica_added",
            address=address,
            replica=info.replica_name,
            layers=format_layers(layers),
        )

    def pending(self, address: str, why: str) -> None:
        """A replica that could not be added now (still loading, unreachable, other model);
        the next refresh tries again."""
        log_event(log, "cluster_replica_pending", address=address, error=why)

    def layers(self) -> dict[int, list[str]]:
        """Layer -> addresses of the replicas that serve it."""
        with self._lock:
            served: dict[int, list[str]] = {}
            for replica in self._replicas.values():
                for layer in replica.layers:
                    served.setdefault(layer, []).append(replica.address)
            return {layer: sorted(addresses) for layer, addresses in sorted(served.items())}

    # -- routing -------------------------------------------------------------------------

    def plan(self, layer: int, segments: Segments | None) -> list[str]:
        """Addresses to try for one request, in order. Raises Unavailable when no replica
        serves ``layer``."""
        key = batch_key(segments)
        now = time.monotonic()
        with self._lock:
            candidates = [r for r in self._replicas.values() if layer in r.layers]
            if not candidates:
                raise Unavailable(self._no_replica(layer))
            groups: dict[tuple[int, ...], list[Replica]] = {}
            for replica in candidates:
                groups.setdefault(replica.layers, []).append(replica)
            ranked: list[Replica] = []
            for group, members in sorted(groups.items(), key=lambda g: -len(g[1])):
                ranked += self._rank(group, members, key)
            busy = self.settings.max_in_flight
            order = sorted(
                ranked,
                key=lambda r: (r.down_until > now, r.in_flight >= busy),
            )  # stable: the affinity order within each class
            if order[0] is not ranked[0] and ranked[0].down_until <= now:
                self._stats.spills += 1
            return [r.address for r in order]

    def _rank(
        self, group: tuple[int, ...], members: list[Replica], key: str | None
    ) -> list[Replica]:
        if key is None:
            return sorted(members, key=lambda r: (r.in_flight, r.address))
        # Hash on replica names (StatefulSet pod names outlive their IPs) when they are
        # unique in the group, else on addresses.
        by_name = {r.name: r for r in members}
        if len(by_name) < len(members):
            by_name = {r.address: r for r in members}
        table = self._tables.get(group)
        if table is None:
            table = self._tables[group] = AffinityTable(self.settings.balance)
        return [by_name[n] for n in table.rank(key, sorted(by_name))]

    def _no_replica(self, layer: int) -> str:
        if not self._replicas:
            return (
                f"no executor replica is known for layer {layer}: none of the endpoints "
                "resolved to a replica that answered GetExecutorInfo"
            )
        served = sorted({layer for r in self._replicas.values() for layer in r.layers})
        return (
            f"no executor replica serves layer {layer}; "
            f"the known ones serve {format_layers(served)}"
        )

    # -- outcomes ------------------------------------------------------------------------

    def begin(self, address: str) -> None:
        with self._lock:
            replica = self._replicas.get(address)
            if replica is not None:
                replica.in_flight += 1

    def end(self, address: str) -> None:
        with self._lock:
            replica = self._replicas.get(address)
            if replica is not None:
                replica.in_flight -= 1

    def failed(self, address: str, error: MoeLoraError) -> bool:
        """Records a failed attempt; True when the next replica should be tried."""
        with self._lock:
            if error.code in _REPLICA_GONE:
                replica = self._replicas.get(address)
                if replica is not None:
                    replica.down_until = time.monotonic() + self.settings.eject_seconds
                self._stats.failovers += 1
                return True
            if error.code is grpc.StatusCode.RESOURCE_EXHAUSTED and "slots" in error.message:
                # Slots busy with other requests: another replica may have room. (Too many
                # tokens is RESOURCE_EXHAUSTED too, but no replica would take those.)
                self._stats.spills += 1
                return True
            return False

    def answered(
        self, address: str, segments: Segments | None, result: ForwardResult[torch.Tensor]
    ) -> None:
        with self._lock:
            replica = self._replicas.get(address)
            if replica is not None:
                replica.down_until = 0.0
            self._stats.requests += 1
            self._stats.adapters_loaded += result.adapters_loaded
            if batch_key(segments) is not None:
                if result.adapters_resident:
                    self._stats.hits += 1
                else:
                    self._stats.misses += 1

    def exhausted(self, layer: int, tried: int, error: MoeLoraError | None) -> Unavailable:
        """The error of a call that no replica answered."""
        return Unavailable(
            f"layer {layer}: every replica serving it failed or the deadline passed "
            f"({tried} tried); last error: {error}"
        )

    def stats(self) -> ClusterStats:
        with self._lock:
            return dataclasses.replace(self._stats)
