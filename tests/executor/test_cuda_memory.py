"""Same-host CUDA memory: a client process exports device memory by CUDA IPC, registers it once
and names Forward's input and output in it; the executor's kernels read and write it in place.

On the GPU: answers equal those sent as bytes bit for bit (the same kernels on the same
launch sizes: graphs, and an eager launch past the largest graph), every bound and mix of
memories is checked, a region unregistered while a client keeps calling fails those calls
alone, and a client that dies with requests in flight leaves the executor serving. The client
is another process, as CUDA IPC requires (a handle cannot be opened in the process that made
it). On the CPU: the RPCs answer with the errors a CPU executor owes.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import grpc
import numpy as np
import pytest
import torch

from executor_service.serving.regions import SharedRegions
from kernels.synthetic import worst_row_error
from moelora.client import cuda_ipc
from moelora.client.errors import FailedPrecondition, MoeLoraError
from moelora.client.executor import ExecutorClient, RetryPolicy
from moelora.client.executor_aio import AsyncExecutorClient
from moelora.v1 import executor_pb2 as ex
from moelora.v1 import executor_pb2_grpc, tensor_pb2
from tests.executor.conftest import StartExecutor
from tests.executor.test_gpu_serving import World, _running, make_world
from tests.executor.worlds import World as CpuWorld

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
BF16 = tensor_pb2.DATA_TYPE_BFLOAT16

#: (tokens, segments) of the parity calls: graph buckets 1, 8 and 256, and an eager launch
#: past the largest bucket (512).
CASES: list[tuple[int, list[tuple[int, str | None]]]] = [
    (1, [(1, "alpha")]),
    (7, [(3, "beta"), (4, None)]),
    (129, [(100, "alpha"), (29, "gamma")]),
    (600, [(600, "beta")]),
]
MAX_TOKENS = 600
#: A request's bf16 answer merged with others against it alone (worst row, relative).
MERGED_BF16_ROW = 1e-2


def _code(call: Any) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert isinstance(info.value, grpc.Call)
    return info.value.code()


# -- on the CPU -------------------------------------------------------------------------------


def test_a_cpu_executor_refuses_cuda_memory_naming_the_field(
    qwen_world: CpuWorld, start_executor: StartExecutor
) -> None:
    running = start_executor(qwen_world)
    with grpc.insecure_channel(running.app.address) as channel:
        stub = executor_pb2_grpc.ExecutorStub(channel)

        def register(handle: bytes) -> Any:
            return lambda: stub.RegisterCudaMemory(
                ex.RegisterCudaMemoryRequest(region="r", ipc_handle=handle, size=1024)
            )

        assert _code(register(b"\1" * 10)) is grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as info:
            register(b"\1" * cuda_ipc.HANDLE_BYTES)()
        assert info.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert "ipc_handle" in (info.value.details() or "")
        assert not stub.ListCudaMemory(ex.ListCudaMemoryRequest()).regions
        missing = ex.UnregisterCudaMemoryRequest(region="r")
        assert _code(lambda: stub.UnregisterCudaMemory(missing)) is grpc.StatusCode.NOT_FOUND


def test_unregistering_names_the_kind_of_memory(tmp_path: Any) -> None:
    """A shared-memory region is not a CUDA one: UnregisterCudaMemory does not remove it."""
    from moelora.client.shared_memory import Segment

    regions = SharedRegions()
    segment = Segment.create_unique("moelora-test", 4096)
    try:
        regions.register("scope", "r", segment.name, 4096)
        with pytest.raises(MoeLoraError):
            regions.unregister("scope", "r", "cuda")
        assert [r.region for r in regions.list("scope", "shm")] == ["r"]
        assert not regions.list("scope", "cuda")
        with pytest.raises(FailedPrecondition):
            regions.register_cuda(
                "scope", "c", b"\0" * cuda_ipc.HANDLE_BYTES, 64, "", torch.device("cpu")
            )
        regions.unregister("scope", "r", "shm")
    finally:
        segment.close()


# -- on the GPU: the client is another process ------------------------------------------------


def _client(address: str, layer: int, hidden: torch.Tensor, script: str, conn: Connection) -> None:
    """A client process: runs ``script`` against the executor and sends back what it saw."""
    try:
        conn.send(_SCRIPTS[script](address, layer, hidden))
    except BaseException as exc:  # the parent fails the test with it
        conn.send({"error": repr(exc)})
    finally:
        conn.close()


def _parity(address: str, layer: int, hidden: torch.Tensor) -> dict[str, Any]:
    device = torch.device("cuda")
    with ExecutorClient(address, timeout=60, retry=RetryPolicy(attempts=1)) as client:
        size = int(hidden.shape[1])
        with client.cuda_memory(size, MAX_TOKENS, device, slots=2) as ring:
            outputs = []
            for tokens, segments in CASES:
                on_gpu = hidden[:tokens].to(device, torch.bfloat16)
                result = client.forward(layer, on_gpu, segments, ring=ring)
                assert result.output.is_cuda
                outputs.append(_portable(result.output))
            errors = _errors(client, ring.region, layer, size, ring.buffer.nbytes)
            listed = [(r.region, r.size) for r in client._stub.ListCudaMemory(
                ex.ListCudaMemoryRequest()).regions]  # fmt: skip
    return {"outputs": outputs, "errors": errors, "listed": listed, "region": ring.region}


def _errors(
    client: ExecutorClient, region: str, layer: int, size: int, nbytes: int
) -> dict[str, tuple[str, str]]:
    """What the executor answers to requests a client could get wrong."""
    stub = client._stub

    def forward(offset: int, out_offset: int, tokens: int = 4, out: str = "") -> ex.ForwardRequest:
        shape = [tokens, size]
        return ex.ForwardRequest(
            layer=layer,
            shared_hidden_states=ex.SharedTensor(
                region=region, offset=offset, dtype=BF16, shape=shape
            ),
            shared_output=ex.SharedTensor(
                region=out or region, offset=out_offset, dtype=BF16, shape=shape
            ),
        )

    cases = {
        "past the end": forward(nbytes - 16, 0),
        "output past the end": forward(0, nbytes - 2),
        "odd offset": forward(1, 4096),
        "unknown region": forward(0, 4096, out="nobody"),
    }
    # Input in CUDA memory, output returned as bytes: the two must be in the same kind.
    mixed = forward(0, 4096)
    mixed.ClearField("shared_output")
    cases["mixed memories"] = mixed
    seen: dict[str, tuple[str, str]] = {}
    for name, request in cases.items():
        try:
            stub.Forward(request, timeout=30)
            seen[name] = ("OK", "")
        except grpc.RpcError as exc:
            seen[name] = (exc.code().name, exc.details() or "")
    buffer = cuda_ipc.DeviceBuffer(4096, torch.device("cuda"))
    try:
        for name, register in {
            "size beyond the allocation": ex.RegisterCudaMemoryRequest(
                region="too-big", ipc_handle=buffer.ipc_handle, size=1 << 26
            ),
            "a GPU it cannot see": ex.RegisterCudaMemoryRequest(
                region="elsewhere", ipc_handle=buffer.ipc_handle, size=4096,
                device_uuid="GPU-00000000-0000-0000-0000-000000000000",
            ),
            "a name taken": ex.RegisterCudaMemoryRequest(
                region=region, ipc_handle=buffer.ipc_handle, size=4096
            ),
        }.items():  # fmt: skip
            try:
                stub.RegisterCudaMemory(register, timeout=30)
                seen[name] = ("OK", "")
            except grpc.RpcError as exc:
                seen[name] = (exc.code().name, exc.details() or "")
    finally:
        buffer.close()
    return seen


def _unregister_while_calling(address: str, layer: int, hidden: torch.Tensor) -> dict[str, Any]:
    """One thread calls through the ring while the main thread unregisters it: calls before
    answer right, calls after fail NOT_FOUND, and the memory is freed only after both."""
    device = torch.device("cuda")
    codes: list[str] = []
    outputs: list[np.ndarray[Any, Any]] = []
    with (
        ExecutorClient(address, timeout=60, retry=RetryPolicy(attempts=1)) as client,
        client.cuda_memory(int(hidden.shape[1]), 64, device, slots=1) as ring,
    ):
        on_gpu = hidden[:16].to(device, torch.bfloat16)
        started = threading.Event()

        def calls() -> None:
            for _ in range(200):
                slot = ring.take(on_gpu)
                assert slot is not None
                try:
                    request = ring.request(slot, on_gpu, layer, [ex.Segment(
                        num_tokens=16, adapter="alpha")])  # fmt: skip
                    client._stub.Forward(request, timeout=30)
                    outputs.append(_portable(ring.output(slot, on_gpu)))
                    codes.append("OK")
                except grpc.RpcError as exc:
                    codes.append(exc.code().name)
                finally:
                    ring.give_back(slot)
                started.set()

        worker = threading.Thread(target=calls)
        worker.start()
        started.wait(60)
        client._stub.UnregisterCudaMemory(ex.UnregisterCudaMemoryRequest(region=ring.region))
        worker.join(120)
    return {"codes": codes, "outputs": outputs}


def _die_mid_request(address: str, layer: int, hidden: torch.Tensor) -> dict[str, Any]:
    """Sends requests through CUDA memory and exits without waiting for them (nor
    unregistering, nor freeing: the process's end does that)."""
    device = torch.device("cuda")
    client = ExecutorClient(address, timeout=60, retry=RetryPolicy(attempts=1))
    ring_context = client.cuda_memory(int(hidden.shape[1]), 512, device, slots=4)
    ring = ring_context.__enter__()
    on_gpu = hidden[:512].to(device, torch.bfloat16)
    for _ in range(4):
        slot = ring.take(on_gpu)
        assert slot is not None
        request = ring.request(slot, on_gpu, layer, [ex.Segment(num_tokens=512, adapter="alpha")])
        client._stub.Forward.future(request, timeout=30)
    time.sleep(0.005)  # in flight, some of them inside a launch
    os._exit(0)


def _unasked(address: str, layer: int, hidden: torch.Tensor) -> dict[str, Any]:
    """A plain client given CUDA tensors: it takes the device path by itself."""
    device = torch.device("cuda")
    with ExecutorClient(address, timeout=60, retry=RetryPolicy(attempts=1)) as client:
        before = client.transport
        outputs = []
        for tokens, segments in CASES:
            result = client.forward(layer, hidden[:tokens].to(device, torch.bfloat16), segments)
            assert result.output.is_cuda
            outputs.append(_portable(result.output))
        channels = client._device_path._channels if client._device_path is not None else []
        spun = [getattr(c, "block", None) is not None for c in channels]
        return {"before": before, "after": client.transport, "outputs": outputs, "spun": spun}


def _unasked_async(address: str, layer: int, hidden: torch.Tensor) -> dict[str, Any]:
    """A plain asyncio client given CUDA tensors, every case in flight at once: one ring and
    one channel carry them all."""
    device = torch.device("cuda")

    async def calls() -> dict[str, Any]:
        async with AsyncExecutorClient(
            address, timeout=60, retry=RetryPolicy(attempts=1)
        ) as client:
            before = client.transport
            results = await asyncio.gather(
                *(
                    client.forward(layer, hidden[:tokens].to(device, torch.bfloat16), segments)
                    for tokens, segments in CASES
                )
            )
            assert all(r.output.is_cuda for r in results)
            outputs = [_portable(r.output) for r in results]
            return {"before": before, "after": client.transport, "outputs": outputs}

    return asyncio.run(calls())


def _portable(tensor: torch.Tensor) -> np.ndarray[Any, Any]:
    """An answer as the parent can receive it after this process is gone (a torch tensor
    would travel as a handle to this process's memory); bf16 to float32 is exact."""
    return tensor.float().cpu().numpy()


_SCRIPTS = {
    "parity": _parity,
    "unregister": _unregister_while_calling,
    "die": _die_mid_request,
    "unasked": _unasked,
    "unasked_async": _unasked_async,
}


def _run_client(address: str, layer: int, hidden: torch.Tensor, script: str) -> Any:
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe(duplex=False)
    process = context.Process(target=_client, args=(address, layer, hidden, script, child))
    process.start()
    child.close()
    got = parent.recv() if parent.poll(300) else {"error": "no answer within 300 s"}
    process.join(60)
    if isinstance(got, dict) and "error" in got:
        pytest.fail(f"client process: {got['error']}")
    return got


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    return make_world(tmp_path_factory.mktemp("cuda_memory_world"))


def _long_input(world: World) -> torch.Tensor:
    generator = torch.Generator().manual_seed(11)
    return torch.randn(MAX_TOKENS, world.hidden.shape[1], generator=generator)


@needs_gpu
@pytest.mark.gpu
def test_forward_through_cuda_memory_equals_forward_with_bytes(world: World) -> None:
    hidden = _long_input(world)
    with _running(world, batch_window_us=0) as running:
        got = _run_client(running.app.address, world.layer, hidden, "parity")
        # The parity calls, and the three of _errors that name its memory but fail a bound.
        assert (
            running.metric(
                "moelora_executor_forward_requests_by_transport_total", transport="cuda_memory"
            )
            == len(CASES) + 3
        )
        for (tokens, segments), output in zip(CASES, got["outputs"], strict=True):
            as_bytes = hidden[:tokens].to(torch.bfloat16)
            expected = running.client.forward(world.layer, as_bytes, segments).output
            assert np.array_equal(output, _portable(expected)), f"T={tokens} differs from bytes"
        errors = got["errors"]
        for name in ("past the end", "output past the end", "odd offset", "mixed memories"):
            assert errors[name][0] == "INVALID_ARGUMENT", (name, errors[name])
            assert "shared_" in errors[name][1], (name, errors[name])
        assert errors["unknown region"][0] == "NOT_FOUND", errors["unknown region"]
        assert errors["size beyond the allocation"][0] == "FAILED_PRECONDITION"
        assert "size" in errors["size beyond the allocation"][1]
        assert errors["a GPU it cannot see"][0] == "FAILED_PRECONDITION"
        assert "device_uuid" in errors["a GPU it cannot see"][1]
        assert errors["a name taken"][0] == "ALREADY_EXISTS"
        assert got["listed"] == [(got["region"], got["listed"][0][1])]
        # Still serving, and the ring's region went with the client's block.
        with grpc.insecure_channel(running.app.address) as channel:
            stub = executor_pb2_grpc.ExecutorStub(channel)
            assert not stub.ListCudaMemory(ex.ListCudaMemoryRequest()).regions


@needs_gpu
@pytest.mark.gpu
def test_a_region_unregistered_while_in_use_fails_only_later_calls(world: World) -> None:
    hidden = _long_input(world)
    with _running(world, batch_window_us=0) as running:
        got = _run_client(running.app.address, world.layer, hidden, "unregister")
        codes: list[str] = got["codes"]
        assert "OK" in codes and "NOT_FOUND" in codes, codes
        first_refused = codes.index("NOT_FOUND")
        assert set(codes[first_refused:]) == {"NOT_FOUND"}, codes
        expected = running.client.forward(
            world.layer, hidden[:16].to(torch.bfloat16), [(16, "alpha")]
        ).output
        for output in got["outputs"]:
            assert np.array_equal(output, _portable(expected))


@needs_gpu
@pytest.mark.gpu
def test_a_client_that_dies_mid_request_leaves_the_executor_serving(world: World) -> None:
    hidden = _long_input(world)
    with _running(world, batch_window_us=0) as running:
        context = multiprocessing.get_context("spawn")
        process = context.Process(
            target=_client,
            args=(running.app.address, world.layer, hidden, "die", context.Pipe()[1]),
        )
        process.start()
        process.join(120)
        assert process.exitcode == 0
        # Its region outlives it (nothing told the executor), and the executor still serves.
        with grpc.insecure_channel(running.app.address) as channel:
            stub = executor_pb2_grpc.ExecutorStub(channel)
            regions = stub.ListCudaMemory(ex.ListCudaMemoryRequest()).regions
            assert len(regions) == 1
            stub.UnregisterCudaMemory(ex.UnregisterCudaMemoryRequest(region=regions[0].region))
        for _ in range(3):
            answer = running.client.forward(
                world.layer, hidden[:64].to(torch.bfloat16), [(64, "alpha")]
            )
            assert torch.isfinite(answer.output.float()).all()
        assert running.app.load_error is None


@needs_gpu
@pytest.mark.gpu
def test_an_asyncio_client_takes_the_device_path_by_itself(world: World) -> None:
    """Calls in flight at once from one event loop share the ring and one channel; answers as
    with bytes."""
    hidden = _long_input(world)
    with _running(world, batch_window_us=0) as running:
        got = _run_client(running.app.address, world.layer, hidden, "unasked_async")
        assert (got["before"], got["after"]) == ("message", "cuda_memory+channel")
        assert running.metric(
            "moelora_executor_forward_requests_by_transport_total", transport="cuda_memory"
        ) == len(CASES)
        for (tokens, segments), output in zip(CASES, got["outputs"], strict=True):
            as_bytes = hidden[:tokens].to(torch.bfloat16)
            expected = running.client.forward(world.layer, as_bytes, segments).output
            # Merged into one launch of another size: bf16 rounding of other tiles at most.
            error = worst_row_error(torch.from_numpy(output), expected.float())
            assert error < MERGED_BF16_ROW, f"T={tokens}: {error} from bytes"


@needs_gpu
@pytest.mark.gpu
def test_a_client_takes_the_device_path_by_itself_where_it_can(world: World) -> None:
    """Another process: CUDA memory and a direct channel with a spin block, answers as with
    bytes. The same process as the executor (a handle cannot be opened there): bytes, answers
    the same."""
    hidden = _long_input(world)
    with _running(world, batch_window_us=0) as running:
        got = _run_client(running.app.address, world.layer, hidden, "unasked")
        assert (got["before"], got["after"]) == ("message", "cuda_memory+channel")
        assert got["spun"] == [True]  # its channel polled a spin block
        assert running.metric(
            "moelora_executor_forward_requests_by_transport_total", transport="cuda_memory"
        ) == len(CASES)
        for (tokens, segments), output in zip(CASES, got["outputs"], strict=True):
            as_bytes = hidden[:tokens].to(torch.bfloat16)
            expected = running.client.forward(world.layer, as_bytes, segments).output
            assert np.array_equal(output, _portable(expected)), f"T={tokens} differs from bytes"
        tokens, segments = CASES[1]
        local = running.client.forward(
            world.layer, hidden[:tokens].to("cuda", torch.bfloat16), segments
        )
        assert running.client.transport == "message"
        by_bytes = running.client.forward(world.layer, hidden[:tokens].to(torch.bfloat16), segments)
        assert np.array_equal(_portable(local.output), _portable(by_bytes.output))
