"""``ClusterClient``: Forward over many executors from threads (see ``router`` for the order
in which replicas are tried)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from types import TracebackType

import torch

from moelora.client.cluster.endpoints import Resolver, system_resolver
from moelora.client.cluster.router import ClusterSettings, ClusterStats, Router, Segments
from moelora.client.errors import MoeLoraError, Unavailable
from moelora.client.executor import ExecutorClient, ForwardResult, RetryPolicy, RoutingTensors
from moelora.client.logs import log_event

log = logging.getLogger(__name__)


class ClusterClient:
    """Forward for any MoE layer, sent to a replica that serves it.

    ``endpoints``: ``host:port`` entries and/or ``dns:///name:port`` names, re-resolved every
    ``settings.refresh_seconds`` in a background thread; a replica that leaves DNS is dropped,
    one that appears is described with GetExecutorInfo and used. Thread-safe.
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        settings: ClusterSettings | None = None,
        resolver: Resolver = system_resolver,
    ) -> None:
        self.settings = settings or ClusterSettings()
        self._router = Router(self.settings, endpoints, resolver)
        self._clients: dict[str, ExecutorClient] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.refresh()
        self._thread = threading.Thread(target=self._refresh_loop, name="cluster-refresh")
        self._thread.daemon = True
        self._thread.start()

    def __enter__(self) -> ClusterClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        with self._lock:
            for client in self._clients.values():
                client.close()
            self._clients.clear()

    # -- membership ----------------------------------------------------------------------

    def refresh(self) -> None:
        """Re-resolves the endpoints now: drops replicas gone from them, describes new ones."""
        gone, new = self._router.update(self._router.resolve())
        with self._lock:
            closing = [self._clients.pop(a) for a in gone if a in self._clients]
        for client in closing:
            client.close()
        for address in new:
            try:
                info = self._client(address).get_executor_info(self.settings.info_timeout)
            except MoeLoraError as exc:
                self._router.pending(address, exc.message)
                continue
            self._router.add(address, info)

    def wait_for_layers(
        self, layers: Iterable[int], replicas: int = 1, timeout: float = 60.0
    ) -> None:
        """Blocks until each of ``layers`` has ``replicas`` replicas; TimeoutError otherwise."""
        wanted = list(layers)
        deadline = time.monotonic() + timeout
        while True:
            served = self._router.layers()
            short = [layer for layer in wanted if len(served.get(layer, [])) < replicas]
            if not short:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"layers {short} have fewer than {replicas} replicas: {served}")
            time.sleep(0.1)
            self.refresh()

    def layers(self) -> dict[int, list[str]]:
        """Layer -> addresses of the replicas serving it, as known now."""
        return self._router.layers()

    @property
    def stats(self) -> ClusterStats:
        return self._router.stats()

    # -- compute -------------------------------------------------------------------------

    def forward(
        self,
        layer: int,
        hidden: torch.Tensor,
        segments: Segments | None = None,
        routing: RoutingTensors[torch.Tensor] | None = None,
        timeout: float | None = None,
    ) -> ForwardResult[torch.Tensor]:
        """As ``ExecutorClient.forward``, on a replica that serves ``layer``; fails over to
        the next replica on UNAVAILABLE and on busy slots, within one deadline."""
        deadline = time.monotonic() + (timeout or self.settings.timeout)
        try:
            plan = self._router.plan(layer, segments)
        except Unavailable:
            self.refresh()  # a layer nobody served may have just come up
            plan = self._router.plan(layer, segments)
        error: MoeLoraError | None = None
        for address in plan:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            self._router.begin(address)
            try:
                result = self._client(address).forward(layer, hidden, segments, routing, remaining)
            except MoeLoraError as exc:
                if not self._router.failed(address, exc):
                    raise
                error = exc
                continue
            finally:
                self._router.end(address)
            self._router.answered(address, segments, result)
            return result
        raise self._router.exhausted(layer, len(plan), error)

    # -- plumbing ------------------------------------------------------------------------

    def _client(self, address: str) -> ExecutorClient:
        with self._lock:
            client = self._clients.get(address)
            if client is None:
                client = ExecutorClient(
                    address,
                    timeout=self.settings.timeout,
                    max_message_bytes=self.settings.max_message_bytes,
                    retry=RetryPolicy(attempts=1),  # the cluster client retries elsewhere
                )
                self._clients[address] = client
            return client

    def _refresh_loop(self) -> None:
        while not self._stop.wait(self.settings.refresh_seconds):
            try:
                self.refresh()
            except Exception:  # a refresh must never end the loop
                log_event(log, "cluster_refresh_failed", logging.WARNING, exc_info=True)
