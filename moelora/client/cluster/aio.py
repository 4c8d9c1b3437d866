"""``AsyncClusterClient``: the cluster client for asyncio backends (grpc.aio channels)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from types import TracebackType

import torch

from moelora.client.cluster.endpoints import Resolver, system_resolver
from moelora.client.cluster.router import ClusterSettings, ClusterStats, Router, Segments
from moelora.client.errors import MoeLoraError, Unavailable
from moelora.client.executor import ForwardResult, RetryPolicy, RoutingTensors
from moelora.client.executor_aio import AsyncExecutorClient
from moelora.client.logs import log_event

log = logging.getLogger(__name__)


class AsyncClusterClient:
    """As ``ClusterClient``, awaitable. Use ``async with`` (or ``await start()`` and
    ``await close()``): the first refresh and the refresh task run there."""

    def __init__(
        self,
        endpoints: Sequence[str],
        settings: ClusterSettings | None = None,
        resolver: Resolver = system_resolver,
    ) -> None:
        self.settings = settings or ClusterSettings()
        self._router = Router(self.settings, endpoints, resolver)
        self._clients: dict[str, AsyncExecutorClient] = {}
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> AsyncClusterClient:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.close()

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._refresh_loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for client in self._clients.values():
            await client.close()
        self._clients.clear()

    @property
    def stats(self) -> ClusterStats:
        return self._router.stats()

    def layers(self) -> dict[int, list[str]]:
        return self._router.layers()

    async def refresh(self) -> None:
        """Re-resolves the endpoints now: drops replicas gone from them, describes new ones."""
        addresses = await asyncio.to_thread(self._router.resolve)
        gone, new = self._router.update(addresses)
        for address in gone:
            client = self._clients.pop(address, None)
            if client is not None:
                await client.close()
        for address in new:
            try:
                info = await self._client(address).get_executor_info(self.settings.info_timeout)
            except MoeLoraError as exc:
                self._router.pending(address, exc.message)
                continue
            self._router.add(address, info)

    async def forward(
        self,
        layer: int,
        hidden: torch.Tensor,
        segments: Segments | None = None,
        routing: RoutingTensors[torch.Tensor] | None = None,
        timeout: float | None = None,
    ) -> ForwardResult[torch.Tensor]:
        """As ``ClusterClient.forward``."""
        deadline = time.monotonic() + (timeout or self.settings.timeout)
        try:
            plan = self._router.plan(layer, segments)
        except Unavailable:
            await self.refresh()
            plan = self._router.plan(layer, segments)
        error: MoeLoraError | None = None
        for address in plan:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            self._router.begin(address)
            try:
                client = self._client(address)
                result = await client.forward(layer, hidden, segments, routing, remaining)
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

    def _client(self, address: str) -> AsyncExecutorClient:
        client = self._clients.get(address)
        if client is None:
            client = self._clients[address] = AsyncExecutorClient(
                address,
                timeout=self.settings.timeout,
                max_message_bytes=self.settings.max_message_bytes,
                retry=RetryPolicy(attempts=1),  # the cluster client retries elsewhere
            )
        return client

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.refresh_seconds)
            try:
                await self.refresh()
            except Exception:  # a refresh must never end the loop
                log_event(log, "cluster_refresh_failed", logging.WARNING, exc_info=True)
