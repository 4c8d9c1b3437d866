"""Network channels: a client on another host (here: the CPU executor's Gloo backend over TCP
on 127.0.0.1) gets a ticket over gRPC (OpenChannel{network}), connects to the engine's TCP
listener and joins a two-rank process group with it; per request the descriptor goes over TCP
and the tensors over the group. Answers equal the float32 reference; an error answer keeps the
channel usable (its transfers still pair up); a descriptor that would unpair them, a client
that vanishes mid-request, or a ticket for the other kind of channel ends that channel alone."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import textwrap

import pytest
import torch

from moelora.client import AsyncExecutorClient, network_group
from moelora.client.engine_wire import Connection, ForwardDescriptor, Kind, TensorRef
from moelora.client.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from moelora.v1 import executor_pb2 as ex
from moelora.v1 import tensor_pb2
from tests.conftest import wait_for
from tests.executor.conftest import Placement, Running, StartExecutor, slowed_kernel
from tests.executor.worlds import TOKENS, World

CPU = torch.device("cpu")
#: Float32 on the CPU against the float32 reference (as test_channels' bytes path).
TOLERANCE = 1e-5


def _network(world: World, start: StartExecutor, **overrides: object) -> Running:
    return start(world, network_channel_port=0, network_channel_host="127.0.0.1", **overrides)


def test_a_network_channel_answers_as_the_reference(
    qwen_world: World, start_executor: StartExecutor
) -> None:
    running = _network(qwen_world, start_executor)
    layer = qwen_world.moe_layers[0]
    hidden = qwen_world.inputs[layer]
    mixes: list[list[tuple[int, str | None]]] = [
        [(TOKENS, "alpha")],
        [(3, None), (TOKENS - 3, "beta")],
        [(TOKENS, None)],
    ]
    gauge = "moelora_executor_channels_open"
    with running.client.open_network_channel(CPU) as channel:
        assert running.metric(gauge, kind="network") == 1
        assert running.metric(gauge, kind="direct") == 0
        for mix in mixes:
            output, result = channel.forward(layer, hidden, mix)
            _assert_answer(output, qwen_world, layer, mix)
            assert len(result.resolved_adapters) == len(mix)
        # Half the rows, in bfloat16: the buffer serves any size up to its limit, and the
        # answer is the one the same request's bytes get.
        half = hidden[:4].to(torch.bfloat16)
        output, _ = channel.forward(layer, half, [(4, "alpha")])
        assert output.dtype == torch.bfloat16
        assert torch.equal(output, running.client.forward(layer, half, [(4, "alpha")]).output)
        with pytest.raises(NotFound):  # the engine's error, raised as Forward's would be
            channel.forward(layer, hidden, [(TOKENS, "no-such-adapter")])
        output, _ = channel.forward(layer, hidden, mixes[0])  # the transfers still pair up
        _assert_answer(output, qwen_world, layer, mixes[0])
    transports = "moelora_executor_forward_requests_by_transport_total"
    assert running.metric(transports, transport="network_channel") == len(mixes) + 3
    wait_for(lambda: running.metric(gauge, kind="network") == 0, timeout=30)


def test_a_network_channel_leases_adapters_named_by_handle(
    qwen_world: World, start_executor: StartExecutor
) -> None:
    running = _network(qwen_world, start_executor)
    layer = qwen_world.moe_layers[0]
    hidden = qwen_world.inputs[layer]
    with running.client.open_network_channel(CPU, adapters=["beta"]) as channel:
        assert channel.leased == ["beta:1"]
        output, result = channel.forward(layer, hidden, [(3, None), (TOKENS - 3, "#0")])
        assert list(result.resolved_adapters) == ["", "beta:1"]
        expected = qwen_world.expected(layer, [(3, None), (TOKENS - 3, "beta")])
        torch.testing.assert_close(output, expected, atol=TOLERANCE, rtol=TOLERANCE)
        with pytest.raises(InvalidArgument, match="segments"):  # a handle it did not lease
            channel.forward(layer, hidden, [(TOKENS, "#1")])


def test_asyncio_network_channels_answer_calls_that_overlap(
    qwen_world: World, start_executor: StartExecutor
) -> None:
    """Two asyncio channels, each with calls queued on it, all in flight from one event loop;
    an error answer leaves its channel usable."""
    running = _network(qwen_world, start_executor)
    layer = qwen_world.moe_layers[0]
    hidden = qwen_world.inputs[layer]
    mixes: list[list[tuple[int, str | None]]] = [
        [(TOKENS, "alpha")],
        [(3, None), (TOKENS - 3, "beta")],
        [(TOKENS, None)],
        [(TOKENS, "beta")],
    ]

    async def calls() -> list[torch.Tensor]:
        async with AsyncExecutorClient(running.app.address, timeout=30) as client:
            first = await client.open_network_channel(CPU)
            second = await client.open_network_channel(CPU)
            async with first, second:
                outputs = await asyncio.gather(
                    *(
                        (first if i % 2 else second).forward(layer, hidden, mix)
                        for i, mix in enumerate(mixes)
                    )
                )
                with pytest.raises(NotFound):
                    await first.forward(layer, hidden, [(TOKENS, "no-such-adapter")])
                again, _ = await first.forward(layer, hidden, mixes[0])
            return [output for output, _ in outputs] + [again]

    answers = asyncio.run(calls())
    for mix, output in zip([*mixes, mixes[0]], answers, strict=True):
        _assert_answer(output, qwen_world, layer, mix)
    wait_for(lambda: running.app.host.network_channels_open() == 0, timeout=30)


def test_without_a_port_an_executor_refuses_network_channels(
    qwen_world: World, start_executor: StartExecutor
) -> None:
    running = start_executor(qwen_world)
    with pytest.raises(FailedPrecondition, match="network-channel-port"):
        running.client.open_network_channel(CPU)


def test_a_ticket_opens_only_its_own_kind_of_channel(
    qwen_world: World, start_executor: StartExecutor
) -> None:
    running = _network(qwen_world, start_executor)
    stub = running.client._stub
    unix = stub.OpenChannel(ex.OpenChannelRequest())
    network = stub.OpenChannel(ex.OpenChannelRequest(network=True))
    assert network.backend == "gloo" and network.max_in_flight == 1
    assert network.network_address.startswith("127.0.0.1:") and not network.socket_path
    raw = _tcp(network.network_address)  # a direct channel's ticket, over TCP
    raw.send_json(Kind.HELLO, {"ticket": unix.ticket, "pid": os.getpid()})
    assert _reasons(raw)[-1].startswith("unknown or used channel ticket")
    raw.close()


def test_a_descriptor_that_would_unpair_the_transfers_ends_its_channel_alone(
    qwen_world: World, start_executor: StartExecutor
) -> None:
    running = _network(qwen_world, start_executor)
    layer = qwen_world.moe_layers[0]
    hidden = qwen_world.inputs[layer]
    with running.client.open_network_channel(CPU) as good:
        opened = running.client._stub.OpenChannel(ex.OpenChannelRequest(network=True))
        raw, group = _join(opened)
        too_big = TensorRef("", 0, 0, tensor_pb2.DATA_TYPE_FLOAT32, (1 << 20, 1 << 10))
        raw.send(Kind.FORWARD, _descriptor(layer, too_big).encode())
        assert "more than" in _reasons(raw)[-1]
        network_group.abort(group)
        raw.close()
        output, _ = good.forward(layer, hidden, [(TOKENS, "alpha")])  # the others serve on
        _assert_answer(output, qwen_world, layer, [(TOKENS, "alpha")])


def test_a_second_request_in_flight_ends_its_channel_alone(
    qwen_world: World, start_executor: StartExecutor
) -> None:
    """One request at a time: a client that sends the next descriptor before its answer
    could no longer pair its transfers with the engine's; the channel ends, nothing else."""
    running = _network(qwen_world, start_executor, kernel=slowed_kernel(0.5))
    layer = qwen_world.moe_layers[0]
    hidden = qwen_world.inputs[layer]
    opened = running.client._stub.OpenChannel(ex.OpenChannelRequest(network=True))
    raw, group = _join(opened)
    ref = TensorRef("", 0, hidden.numel() * 4, tensor_pb2.DATA_TYPE_FLOAT32, tuple(hidden.shape))
    raw.send(Kind.FORWARD, _descriptor(layer, ref).encode())
    group.send([network_group.as_bytes(hidden.contiguous())], 0, 0).wait()
    raw.send(Kind.FORWARD, _descriptor(layer, ref).encode())  # while the first computes
    assert "one request at a time" in _reasons(raw)[-1]
    network_group.abort(group)
    raw.close()
    with running.client.open_network_channel(CPU) as channel:
        output, _ = channel.forward(layer, hidden, [(TOKENS, "alpha")])
        _assert_answer(output, qwen_world, layer, [(TOKENS, "alpha")])


def test_a_client_that_vanishes_mid_request_leaves_the_engine_serving(
    qwen_world: World, start_executor: StartExecutor
) -> None:
    """A client process sends a descriptor and exits before its tensor: the engine's wait for
    it notices the closed socket, the channel ends, and other channels answer."""
    running = _network(qwen_world, start_executor)
    layer = qwen_world.moe_layers[0]
    opened = running.client._stub.OpenChannel(ex.OpenChannelRequest(network=True))
    script = _vanishing_client(opened, layer, "cpu")
    subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
    with running.client.open_network_channel(CPU) as channel:
        hidden = qwen_world.inputs[layer]
        output, _ = channel.forward(layer, hidden, [(TOKENS, "beta")])
        _assert_answer(output, qwen_world, layer, [(TOKENS, "beta")])
    wait_for(lambda: running.app.host.network_channels_open() == 0, timeout=30)


def test_past_the_limit_a_network_channel_is_turned_away(
    qwen_world: World, start_executor: StartExecutor
) -> None:
    running = _network(qwen_world, start_executor, max_network_channels=1)
    with (
        running.client.open_network_channel(CPU),
        pytest.raises(Unavailable, match="the most the engine takes"),
    ):
        running.client.open_network_channel(CPU, timeout=10)


def _vanishing_client(opened: ex.OpenChannelResponse, layer: int, device: str) -> str:
    """A client process that joins the channel, sends a descriptor and exits without its
    tensor (or a goodbye)."""
    return textwrap.dedent(
        f"""
        import os, socket
        import torch
        from moelora.client import network_group
        from moelora.client.engine_wire import Connection, ForwardDescriptor, Kind, TensorRef
        host, port = {opened.network_address!r}.rsplit(":", 1)
        raw = Connection(socket.create_connection((host, int(port))))
        raw.send_json(Kind.HELLO, {{"ticket": {opened.ticket!r}, "pid": os.getpid()}})
        store = network_group.store_client({opened.store_address!r})
        group = network_group.channel_group(store, {opened.ticket!r}, 1, {opened.backend!r})
        hello = torch.zeros(network_group.HELLO_BYTES, dtype=torch.uint8, device={device!r})
        group.send([hello], 0, 0).wait()
        if hello.is_cuda:
            torch.cuda.synchronize()
        ref = TensorRef("", 0, {TOKENS * 64 * 4}, 1, ({TOKENS}, 64))
        descriptor = ForwardDescriptor(1, {layer}, 1.0, 0.0, "", ref, ref, (({TOKENS}, ""),))
        raw.send(Kind.FORWARD, descriptor.encode())
        os._exit(0)
        """
    )


def _assert_answer(
    output: torch.Tensor, world: World, layer: int, mix: list[tuple[int, str | None]]
) -> None:
    """``output`` against the float32 reference of ``mix`` on ``layer``."""
    torch.testing.assert_close(output, world.expected(layer, mix), atol=TOLERANCE, rtol=TOLERANCE)


def _descriptor(layer: int, ref: TensorRef) -> ForwardDescriptor:
    return ForwardDescriptor(1, layer, 1.0, 0.0, "", ref, ref, ((TOKENS, ""),))


def _tcp(address: str) -> Connection:
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    return Connection(sock)


def _join(opened: ex.OpenChannelResponse) -> tuple[Connection, network_group.Group]:
    """A raw client of the channel: connected, admitted and in the group."""
    raw = _tcp(opened.network_address)
    raw.send_json(Kind.HELLO, {"ticket": opened.ticket, "pid": os.getpid()})
    store = network_group.store_client(opened.store_address)
    group = network_group.channel_group(store, opened.ticket, 1, opened.backend)
    group.send([torch.zeros(network_group.HELLO_BYTES, dtype=torch.uint8)], 0, 0).wait()
    return raw, group


def _reasons(raw: Connection) -> list[str]:
    """The STATE reasons the engine sent until it hung up."""
    import json

    reasons: list[str] = []
    try:
        while True:
            kind, payload = raw.recv()
            if kind is Kind.STATE:
                reasons.append(json.loads(payload)["reason"])
    except (EOFError, OSError):
        return reasons


TWO_GPUS = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="NCCL between two GPUs (a group's ranks need GPUs of their own)",
)


@pytest.mark.gpu
@TWO_GPUS
def test_between_two_gpus_nccl_answers_as_the_reference(
    qwen_world: World, start_executor: StartExecutor
) -> None:
    """The executor on GPU 0 (float32, CUDA graphs), the client on GPU 1: the tensors go over
    NCCL; a client that vanishes mid-request ends its channel alone."""
    placement = Placement("cuda")
    running = _network(qwen_world, start_executor, **placement.settings)
    layer = qwen_world.moe_layers[0]
    client_gpu = torch.device("cuda", 1)
    hidden = qwen_world.inputs[layer].to(client_gpu)
    opened = running.client._stub.OpenChannel(ex.OpenChannelRequest(network=True))
    assert opened.backend == "nccl"
    script = _vanishing_client(opened, layer, "cuda:1")
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    with running.client.open_network_channel(client_gpu) as channel:
        mixes: list[list[tuple[int, str | None]]] = [
            [(TOKENS, "alpha")],
            [(3, None), (TOKENS - 3, "beta")],
        ]
        for mix in mixes:
            for _ in range(3):
                output, _ = channel.forward(layer, hidden, mix)
                assert output.device == client_gpu
                placement.check(output.cpu(), qwen_world.expected(layer, mix))
    wait_for(lambda: running.app.host.network_channels_open() == 0, timeout=60)


def test_nccl_groups_are_made_to_abort_alone_and_leave_the_environment_as_it_was(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch reads its NCCL error handling as it constructs a group: while a channel's group is
    made the environment says "abort this communicator alone" (its default tears the process
    down), unless the process set it; after, the process's own groups see what they saw."""
    handling, monitoring = "TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_ENABLE_MONITORING"
    monkeypatch.delenv(handling, raising=False)
    monkeypatch.setenv(monitoring, "1")  # an operator's choice
    with network_group.nccl_group_defaults():
        assert os.environ[handling] == "2"
        assert os.environ[monitoring] == "1"
    assert handling not in os.environ
    assert os.environ[monitoring] == "1"


def test_the_wait_for_a_tensor_ends_when_its_client_hangs_up() -> None:
    """The engine's wait for an NCCL transfer (polled, ``_poll``) watches the channel's socket:
    bytes from the client are not a hang-up, a closed socket is, and the wait then ends
    (a transfer that never completes stands in for a dead peer's)."""
    from executor_service.serving.network_channels import ChannelBroken, _poll, peer_gone

    class NeverCompletes:
        def is_completed(self) -> bool:
            return False

    engine_end, client_end = socket.socketpair()
    gone = peer_gone(engine_end)
    assert not gone()
    client_end.send(b"x")  # a frame's first byte, unread: still there
    assert not gone()
    client_end.close()
    assert gone()
    with pytest.raises(ChannelBroken, match="went away"):
        _poll(NeverCompletes(), gone)  # type: ignore[arg-type]
    engine_end.close()
