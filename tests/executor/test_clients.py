"""The asyncio client: the same answers, errors and retry rules as the sync client; and both
clients' keepalive."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from executor_service.sources import LocalFolderSource
from moelora.client.errors import InvalidArgument, NotFound, Unavailable
from moelora.client.executor import ExecutorClient, ForwardCall, ForwardResult, RetryPolicy
from moelora.client.executor_aio import AsyncExecutorClient
from tests.executor.conftest import (
    GatedSource,
    StartExecutor,
    assert_close,
    slowed_kernel,
)
from tests.executor.worlds import TOKENS, World
from tests.proxy import CuttingProxy


def test_forward_calls_in_flight_together_and_errors(
    qwen_world: World, start_executor: StartExecutor
) -> None:
    running = start_executor(qwen_world)
    layer = qwen_world.moe_layers[0]
    hidden = qwen_world.inputs[layer]

    async def main() -> None:
        async with AsyncExecutorClient(running.app.address, timeout=30) as client:
            await client.wait_until_serving()
            first, second = await asyncio.gather(
                client.forward(layer, hidden, [(TOKENS, "alpha")]),
                client.forward(layer, hidden.to(torch.bfloat16), [(4, None), (8, "beta")]),
            )
            assert_close(first.output, qwen_world.reference[("alpha", layer)])
            assert first.resolved_adapters == ["alpha:1"]
            assert second.output.dtype == torch.bfloat16
            expected = qwen_world.expected(layer, [(4, None), (8, "beta")])
            torch.testing.assert_close(second.output.float(), expected, atol=0.05, rtol=0.05)
            with pytest.raises(NotFound):
                await client.forward(layer, hidden, [(TOKENS, "nosuch")])
            with pytest.raises(InvalidArgument, match="segments"):
                await client.forward(layer, hidden, [(3, "alpha")])
            answers = [
                a
                async for a in client.forward_stream(
                    [
                        ForwardCall(layer, hidden, [(TOKENS, "alpha")]),
                        ForwardCall(layer, hidden, [(TOKENS, "nosuch")]),
                        ForwardCall(layer, hidden, None),
                    ]
                )
            ]
            assert isinstance(answers[0], ForwardResult) and isinstance(answers[1], NotFound)
            assert isinstance(answers[2], ForwardResult)
            assert_close(answers[2].output, qwen_world.reference[(None, layer)])
            loaded = await client.pin_adapter("gamma")
            assert loaded.pinned and (await client.unpin_adapter("gamma")).pinned is False

    asyncio.run(main())


def test_retries_unavailable_while_loading_but_not_without_attempts(
    qwen_world: World, start_executor: StartExecutor
) -> None:
    gate = threading.Event()
    source = GatedSource(LocalFolderSource(qwen_world.adapter_dir), gate)
    running = start_executor(qwen_world, source=source, wait=False, preload_adapters=["alpha"])
    layer = qwen_world.moe_layers[0]

    async def main() -> ForwardResult[torch.Tensor]:
        async with AsyncExecutorClient(
            running.app.address, timeout=30, retry=RetryPolicy(attempts=1)
        ) as impatient:
            with pytest.raises(Unavailable, match="loading"):
                await impatient.get_executor_info()
        async with AsyncExecutorClient(
            running.app.address, timeout=30, retry=RetryPolicy(attempts=100)
        ) as patient:
            call = asyncio.create_task(
                patient.forward(layer, qwen_world.inputs[layer], [(TOKENS, "alpha")])
            )
            await asyncio.sleep(0.3)  # retrying meanwhile
            gate.set()
            return await call

    result = asyncio.run(main())
    assert_close(result.output, qwen_world.reference[("alpha", layer)])


def test_overloaded_is_retried_after_its_hint(
    qwen_world: World, start_executor: StartExecutor
) -> None:
    """One request may wait: of six sent at once most are refused with a hint at first, and
    every one gets through on a retry."""
    # Requests go to the engine alone (see test_batching's full-queue test).
    running = start_executor(
        qwen_world, kernel=slowed_kernel(0.05), max_queued_requests=1, frontend_combine_after=0
    )
    layer = qwen_world.moe_layers[0]

    async def main() -> list[ForwardResult[torch.Tensor]]:
        async with AsyncExecutorClient(
            running.app.address, timeout=30, retry=RetryPolicy(attempts=50)
        ) as client:
            return await asyncio.gather(
                *(
                    client.forward(layer, qwen_world.inputs[layer], [(TOKENS, "alpha")])
                    for _ in range(6)
                )
            )

    results = asyncio.run(main())
    assert running.metric("moelora_executor_overloaded_total") >= 1
    for result in results:
        assert_close(result.output, qwen_world.reference[("alpha", layer)])


def test_a_stream_over_a_connection_gone_silent_fails_in_seconds(
    qwen_world: World, start_executor: StartExecutor
) -> None:
    """A ForwardStream whose connection dies without a word (the proxy holds it open and
    forwards nothing) fails UNAVAILABLE once keepalive (1 s here) finds the unanswered ping,
    not at its deadline a minute later."""
    running = start_executor(qwen_world)
    layer = qwen_world.moe_layers[0]
    hidden = qwen_world.inputs[layer]
    proxy = CuttingProxy(running.app.address)
    silent = threading.Event()

    def calls() -> Iterator[ForwardCall[torch.Tensor]]:
        yield ForwardCall(layer, hidden, [(TOKENS, "alpha")])
        assert silent.wait(30)
        yield ForwardCall(layer, hidden, [(TOKENS, "alpha")])

    try:
        with ExecutorClient(proxy.address, timeout=60, keepalive_seconds=1) as client:
            answers = client.forward_stream(calls())
            first = next(answers)
            assert isinstance(first, ForwardResult)
            assert_close(first.output, qwen_world.reference[("alpha", layer)])
            proxy.limit, proxy.stall = 0, True  # the next bytes from the executor never arrive
            silent.set()
            started = time.monotonic()
            with pytest.raises(Unavailable):
                next(answers)
            assert time.monotonic() - started < 20, "noticed by keepalive, not the deadline"
    finally:
        silent.set()
        proxy.close()


def test_numpy_in_numpy_out_the_same_answers_as_torch(
    qwen_world: World, start_executor: StartExecutor
) -> None:
    running = start_executor(qwen_world)
    layer = qwen_world.moe_layers[0]
    hidden = qwen_world.inputs[layer]
    segments: list[tuple[int, str | None]] = [(4, None), (8, "alpha")]
    with ExecutorClient(running.app.address, timeout=30) as client:
        with_torch = client.forward(layer, hidden, segments)
        with_numpy = client.forward(layer, hidden.numpy(), segments)
        streamed = list(client.forward_stream([ForwardCall(layer, hidden.numpy(), segments)]))
    assert isinstance(with_numpy.output, np.ndarray) and with_numpy.output.dtype == np.float32
    assert with_numpy.output.flags.writeable
    np.testing.assert_array_equal(with_numpy.output, with_torch.output.numpy())
    assert with_numpy.resolved_adapters == with_torch.resolved_adapters == ["", "alpha:1"]
    assert isinstance(streamed[0], ForwardResult) and isinstance(streamed[0].output, np.ndarray)
    np.testing.assert_array_equal(streamed[0].output, with_numpy.output)
