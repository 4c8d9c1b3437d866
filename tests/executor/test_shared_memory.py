"""Same-host shared memory: a client registers a POSIX shared-memory object once and names
Forward's input and output in it; the answer equals the one sent as bytes, every bound is
checked, regions are the registering caller's alone, and a region unregistered while a request
uses it stays whole until that request is answered."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from executor_service.server import _on_this_host
from executor_service.sources import LocalFolderSource
from kernels import LoRAContext, MoELayerWeights, Routing, moe_forward
from moelora.client import AsyncExecutorClient
from moelora.client.errors import DeadlineExceeded, NotFound
from moelora.client.executor import ExecutorClient, RetryPolicy
from moelora.client.shared_memory import SHM_ROOT, Segment
from moelora.client.tensors import from_numpy
from moelora.v1 import executor_pb2 as ex
from moelora.v1 import executor_pb2_grpc, tensor_pb2
from tests.executor.conftest import GatedSource, Running, StartExecutor
from tests.executor.worlds import TOKENS, World

F32 = tensor_pb2.DATA_TYPE_FLOAT32


@contextmanager
def _stub(running: Running, token: str | None = None) -> Iterator[executor_pb2_grpc.ExecutorStub]:
    with grpc.insecure_channel(running.app.address) as channel:
        stub = executor_pb2_grpc.ExecutorStub(channel)
        if token is None:
            yield stub
            return

        class _WithToken:
            def __getattr__(self, name: str) -> object:
                call = getattr(stub, name)
                return lambda request, **kw: call(
                    request, metadata=[("authorization", f"Bearer {token}")], **kw
                )

        yield _WithToken()  # type: ignore[misc]


def _request(world: World, region: str, offset: int, out_offset: int) -> ex.ForwardRequest:
    layer = world.moe_layers[0]
    hidden = world.inputs[layer]
    return ex.ForwardRequest(
        layer=layer,
        segments=[ex.Segment(num_tokens=TOKENS, adapter="alpha")],
        shared_hidden_states=ex.SharedTensor(
            region=region, offset=offset, dtype=F32, shape=list(hidden.shape)
        ),
        shared_output=ex.SharedTensor(
            region=region, offset=out_offset, dtype=F32, shape=list(hidden.shape)
        ),
    )


def _code(call: object) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()  # type: ignore[operator]
    assert isinstance(info.value, grpc.Call)
    return info.value.code()


def test_forward_through_shared_memory_equals_forward_with_bytes(
    qwen_world: World, start_executor: StartExecutor
) -> None:
    running = start_executor(qwen_world)
    layer = qwen_world.moe_layers[0]
    hidden = qwen_world.inputs[layer].numpy()
    nbytes = hidden.nbytes
    ring = Segment.create_unique("moelora-client", 4 * nbytes)
    try:
        with _stub(running) as stub:
            region = stub.RegisterSharedMemory(
                ex.RegisterSharedMemoryRequest(region="ring", shm_name=ring.name, size=ring.size)
            ).region
            assert (region.region, region.shm_name, region.size) == ("ring", ring.name, ring.size)
            ring.buffer[nbytes : 2 * nbytes] = hidden.tobytes()
            answer = stub.Forward(_request(qwen_world, "ring", nbytes, 2 * nbytes), timeout=30)
            assert not answer.HasField("output") and answer.resolved_adapters == ["alpha:1"]
            shared = np.frombuffer(ring.buffer[2 * nbytes : 3 * nbytes], dtype="<f4")
            by_bytes = stub.Forward(
                ex.ForwardRequest(
                    layer=layer,
                    hidden_states=from_numpy(hidden),
                    segments=[ex.Segment(num_tokens=TOKENS, adapter="alpha")],
                ),
                timeout=30,
            )
            expected = np.frombuffer(by_bytes.output.data, dtype="<f4")
            assert np.array_equal(shared, expected)
            listed = stub.ListSharedMemory(ex.ListSharedMemoryRequest()).regions
            assert [r.region for r in listed] == ["ring"]
            stub.UnregisterSharedMemory(ex.UnregisterSharedMemoryRequest(region="ring"))
            assert not stub.ListSharedMemory(ex.ListSharedMemoryRequest()).regions
            gone = _request(qwen_world, "ring", 0, nbytes)
            assert _code(lambda: stub.Forward(gone, timeout=30)) is grpc.StatusCode.NOT_FOUND
    finally:
        ring.close()


def test_every_bound_and_name_is_checked(qwen_world: World, start_executor: StartExecutor) -> None:
    running = start_executor(qwen_world)
    nbytes = qwen_world.inputs[qwen_world.moe_layers[0]].numpy().nbytes
    ring = Segment.create_unique("moelora-client", 2 * nbytes)
    try:
        with _stub(running) as stub:

            def register(name: str, size: int) -> None:
                stub.RegisterSharedMemory(
                    ex.RegisterSharedMemoryRequest(region="r", shm_name=name, size=size)
                )

            assert _code(lambda: register("no-such-object", 16)) is grpc.StatusCode.NOT_FOUND
            assert _code(lambda: register("../x", 16)) is grpc.StatusCode.INVALID_ARGUMENT
            too_big = ring.size + 1
            assert (
                _code(lambda: register(ring.name, too_big)) is grpc.StatusCode.FAILED_PRECONDITION
            )
            register(ring.name, ring.size)
            register(ring.name, ring.size)  # the same again: a no-op
            assert _code(lambda: register(ring.name, 64)) is grpc.StatusCode.ALREADY_EXISTS
            for offset, out in ((ring.size - 8, 0), (0, nbytes + 4), (2, nbytes)):
                request = _request(qwen_world, "r", offset, out)
                with pytest.raises(grpc.RpcError) as info:
                    stub.Forward(request, timeout=30)
                assert isinstance(info.value, grpc.Call)
                assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
                assert "shared_" in (info.value.details() or "")
            ok = stub.Forward(_request(qwen_world, "r", 0, nbytes), timeout=30)
            assert ok.resolved_adapters == ["alpha:1"]
    finally:
        ring.close()


def test_a_link_in_shared_memory_to_another_file_is_refused(
    qwen_world: World, start_executor: StartExecutor, tmp_path: Path
) -> None:
    """A name in /dev/shm that links to a file elsewhere would let a client have the engine
    write its answers there: refused, the file untouched."""
    running = start_executor(qwen_world)
    target = tmp_path / "precious"
    target.write_bytes(b"x" * 65536)
    link = SHM_ROOT / f"moelora-link-{os.getpid()}"
    link.symlink_to(target)
    try:
        with _stub(running) as stub:
            register = ex.RegisterSharedMemoryRequest(region="r", shm_name=link.name, size=4096)
            code = _code(lambda: stub.RegisterSharedMemory(register))
            assert code is grpc.StatusCode.FAILED_PRECONDITION
            assert not stub.ListSharedMemory(ex.ListSharedMemoryRequest()).regions
        assert target.read_bytes() == b"x" * 65536
    finally:
        link.unlink()


def test_regions_belong_to_the_token_that_registered_them(
    qwen_world: World, start_executor: StartExecutor, tokens: tuple[object, dict[str, str]]
) -> None:
    path, secret = tokens
    running = start_executor(qwen_world, auth="on", auth_tokens_file=path)
    nbytes = qwen_world.inputs[qwen_world.moe_layers[0]].numpy().nbytes
    ring = Segment.create_unique("moelora-client", 2 * nbytes)
    try:
        with _stub(running, secret["read"]) as owner, _stub(running, secret["admin"]) as other:
            owner.RegisterSharedMemory(
                ex.RegisterSharedMemoryRequest(region="mine", shm_name=ring.name, size=ring.size)
            )
            assert [
                r.region for r in owner.ListSharedMemory(ex.ListSharedMemoryRequest()).regions
            ] == ["mine"]
            assert not other.ListSharedMemory(ex.ListSharedMemoryRequest()).regions
            request = _request(qwen_world, "mine", 0, nbytes)
            assert _code(lambda: other.Forward(request, timeout=30)) is grpc.StatusCode.NOT_FOUND
            unregister = ex.UnregisterSharedMemoryRequest(region="mine")
            assert (
                _code(lambda: other.UnregisterSharedMemory(unregister)) is grpc.StatusCode.NOT_FOUND
            )
            assert owner.Forward(request, timeout=30).resolved_adapters == ["alpha:1"]
    finally:
        ring.close()


def test_a_region_unregistered_mid_request_stays_whole_until_it_is_answered(
    qwen_world: World, start_executor: StartExecutor
) -> None:
    entered, release = threading.Event(), threading.Event()

    def held_kernel(
        hidden: torch.Tensor,
        layer: MoELayerWeights,
        lora: LoRAContext | None,
        routing: Routing | None,
    ) -> torch.Tensor:
        entered.set()
        release.wait(30)
        return moe_forward(hidden, layer, lora, routing, backend="torch")

    running = start_executor(qwen_world, kernel=held_kernel)
    layer = qwen_world.moe_layers[0]
    hidden = qwen_world.inputs[layer].numpy()
    nbytes = hidden.nbytes
    ring = Segment.create_unique("moelora-client", 2 * nbytes)
    ring.buffer[:nbytes] = hidden.tobytes()
    answers: list[ex.ForwardResponse] = []
    try:
        with _stub(running) as stub:
            register = ex.RegisterSharedMemoryRequest(
                region="r", shm_name=ring.name, size=ring.size
            )
            stub.RegisterSharedMemory(register)
            release.set()
            stub.Forward(_request(qwen_world, "r", 0, nbytes), timeout=30)
            want = bytes(ring.buffer[nbytes : 2 * nbytes])
            ring.buffer[nbytes : 2 * nbytes] = b"\0" * nbytes
            entered.clear()
            release.clear()
            request = _request(qwen_world, "r", 0, nbytes)
            worker = threading.Thread(
                target=lambda: answers.append(stub.Forward(request, timeout=30))
            )
            worker.start()
            assert entered.wait(30), "the request never reached the kernel"
            stub.UnregisterSharedMemory(ex.UnregisterSharedMemoryRequest(region="r"))
            release.set()
            worker.join(30)
            assert [a.resolved_adapters for a in answers] == [["alpha:1"]]
            assert bytes(ring.buffer[nbytes : 2 * nbytes]) == want
            assert _code(lambda: stub.Forward(request, timeout=30)) is grpc.StatusCode.NOT_FOUND
    finally:
        release.set()
        ring.close()


def test_only_callers_on_this_host_may_register() -> None:
    assert _on_this_host("ipv4:127.0.0.1:5000") and _on_this_host("ipv6:[::1]:5000")
    assert _on_this_host("unix:/tmp/executor.sock")
    assert not _on_this_host("ipv4:10.0.0.7:5000") and not _on_this_host("ipv6:[fd00::1]:1")


# -- the client's ring ------------------------------------------------------------------------


def test_the_client_ring_answers_as_bytes_do_and_cleans_up(
    qwen_world: World, start_executor: StartExecutor
) -> None:
    """forward(..., ring=ring) equals forward with bytes, for numpy and torch inputs; a call
    the ring cannot hold (more tokens than a slot) sends bytes; leaving the block unregisters
    the region and removes the shared-memory object."""
    running = start_executor(qwen_world)
    layer = qwen_world.moe_layers[0]
    hidden = qwen_world.inputs[layer]
    hidden_size = int(hidden.shape[1])
    segments = [(TOKENS, "alpha")]
    client = running.client
    expected = client.forward(layer, hidden.numpy(), segments).output
    doubled = np.concatenate([hidden.numpy(), hidden.numpy()])
    expected_doubled = client.forward(layer, doubled, [(2 * TOKENS, "alpha")]).output
    with client.shared_memory(hidden_size, TOKENS, slots=2, dtype="float32") as ring:
        path = SHM_ROOT / ring.shm_name
        assert path.exists()
        with _stub(running) as stub:
            listed = stub.ListSharedMemory(ex.ListSharedMemoryRequest()).regions
            assert [(r.region, r.shm_name) for r in listed] == [(ring.region, ring.shm_name)]
        by_ring = client.forward(layer, hidden.numpy(), segments, ring=ring)
        assert by_ring.resolved_adapters == ["alpha:1"]
        assert np.array_equal(by_ring.output, expected)
        as_torch = client.forward(layer, hidden, segments, ring=ring).output
        assert isinstance(as_torch, torch.Tensor)
        assert np.array_equal(as_torch.numpy(), expected)
        too_long = client.forward(layer, doubled, [(2 * TOKENS, "alpha")], ring=ring).output
        assert np.array_equal(too_long, expected_doubled)
    assert not path.exists()
    with _stub(running) as stub:
        assert not stub.ListSharedMemory(ex.ListSharedMemoryRequest()).regions


def test_more_callers_than_slots_all_get_their_own_answers(
    qwen_world: World, start_executor: StartExecutor
) -> None:
    """Eight threads over a two-slot ring: a caller that finds every slot busy sends bytes;
    every answer is its own input's (distinct inputs, so a slot mixed up would show)."""
    running = start_executor(qwen_world)
    layer = qwen_world.moe_layers[0]
    hidden = qwen_world.inputs[layer].numpy()
    inputs = [hidden * (1 + i / 8) for i in range(8)]
    client = running.client
    expected = [client.forward(layer, x, [(TOKENS, "alpha")]).output for x in inputs]
    failures: list[str] = []
    finished: list[int] = []
    with client.shared_memory(hidden.shape[1], TOKENS, slots=2, dtype="float32") as ring:

        def caller(i: int) -> None:
            try:
                for _ in range(5):
                    out = client.forward(layer, inputs[i], [(TOKENS, "alpha")], ring=ring).output
                    if not np.array_equal(out, expected[i]):
                        failures.append(f"caller {i}: another answer")
                finished.append(i)
            except Exception as exc:  # reported below, with the others
                failures.append(f"caller {i}: {exc!r}")

        threads = [threading.Thread(target=caller, args=(i,)) for i in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
    assert not failures, failures
    assert sorted(finished) == list(range(8))


def test_the_async_client_ring(qwen_world: World, start_executor: StartExecutor) -> None:
    running = start_executor(qwen_world)
    layer = qwen_world.moe_layers[0]
    hidden = qwen_world.inputs[layer].numpy()
    expected = running.client.forward(layer, hidden, [(TOKENS, "alpha")]).output

    async def calls() -> list[np.ndarray]:
        async with (
            AsyncExecutorClient(running.app.address) as client,
            client.shared_memory(hidden.shape[1], TOKENS, dtype="float32") as ring,
        ):
            segments = [(TOKENS, "alpha")]
            calls = [client.forward(layer, hidden, segments, ring=ring) for _ in range(6)]
            results = await asyncio.gather(*calls)
            return [r.output for r in results]

    outputs = asyncio.run(calls())
    assert len(outputs) == 6 and all(np.array_equal(out, expected) for out in outputs)


def test_a_slot_whose_call_ended_without_its_answer_is_not_used_again(
    qwen_world: World, start_executor: StartExecutor
) -> None:
    """A call that timed out may still be computed, its output written into its slot later:
    that slot is retired, not handed to a later call (which then sends bytes, answered
    right). A call the executor answered, even with an error, gives its slot back."""
    gate = threading.Event()  # adapter fetches wait here
    source = GatedSource(LocalFolderSource(qwen_world.adapter_dir), gate)
    running = start_executor(qwen_world, source=source)
    layer = qwen_world.moe_layers[0]
    hidden = qwen_world.inputs[layer].numpy()
    hidden_size = int(hidden.shape[1])
    with ExecutorClient(running.app.address, retry=RetryPolicy(attempts=1)) as client:
        expected = client.forward(layer, hidden).output
        with (
            client.shared_memory(hidden_size, TOKENS, slots=1, dtype="float32") as ring,
            client.shared_memory(hidden_size, TOKENS, slots=1, dtype="float32") as answered,
        ):
            with pytest.raises(DeadlineExceeded):
                client.forward(layer, hidden, [(TOKENS, "alpha")], ring=ring, timeout=0.5)
            assert ring.take(hidden) is None  # retired: the engine still holds the request
            assert np.array_equal(client.forward(layer, hidden, ring=ring).output, expected)
            with pytest.raises(NotFound):
                client.forward(layer, hidden, [(TOKENS, "no-such-adapter")], ring=answered)
            slot = answered.take(hidden)
            assert slot is not None  # answered: given back
            answered.give_back(slot)
            gate.set()
