"""One benchmark client process of ``bench.forward`` and ``bench.load`` (not product API).

Builds one Forward request as a backend would (bf16 hidden states on the wire, the tokens split
evenly over its adapters), sends it ``--warmup`` times, prints ``ready``, waits for ``go`` on
stdin (so that every client of a row starts together), then times ``--iters`` round trips (0:
until ``stop`` on stdin, as ``bench.load`` does while a load runs) and prints one JSON line:
latencies, the executor's ``server_time_us``, each call's wall-clock start, the run's start
and end, and the answers checked. With ``--expected`` (the request's answer computed alone,
float32 .npy) every warm-up answer and every ``CHECK_EVERY``-th timed one is compared with it
row by row after the timed loop (``bench.answers``), so that checking costs the timing nothing.
With ``--transport network`` the tensors go over a network channel from ``--device``.
With ``--transport shm|cuda`` the answer stays where the executor wrote it (the client's shared
or CUDA memory, as a client that uses it in place would have it); the checked ones are copied
out after their call's time is taken.
``--target echo`` sends the same bytes to the echo server instead (the transport floor).
Plain generated stubs, numpy only (torch for ``--transport cuda``): a client process starts
fast and shares nothing with the executor.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from executor_service.bench.answers import tensor_to_float32, worst_row_error
from executor_service.bench.echo_server import STREAM, UNARY
from moelora.client.channel import ForwardChannel, tensor_ref
from moelora.client.engine_wire import ForwardDescriptor, raise_for
from moelora.client.shared_memory import Segment
from moelora.v1 import executor_pb2, executor_pb2_grpc, tensor_pb2

#: Timed answers kept for the check: one in this many.
CHECK_EVERY = 10

_OPTIONS = [
    ("grpc.max_receive_message_length", 256 * 1024 * 1024),
    ("grpc.max_send_message_length", 256 * 1024 * 1024),
]


def bf16_bytes(rows: int, cols: int, seed: int) -> bytes:
    """Random normal values rounded (truncated) to bfloat16, little-endian."""
    values = np.random.default_rng(seed).standard_normal((rows, cols), dtype=np.float32)
    return (values.view(np.uint32) >> 16).astype("<u2").tobytes()


def forward_request(
    layer: int, tokens: int, hidden: int, adapters: list[str], seed: int
) -> executor_pb2.ForwardRequest:
    count = min(len(adapters), tokens) if adapters else 0
    sizes = [tokens // count + (1 if i < tokens % count else 0) for i in range(count)]
    return executor_pb2.ForwardRequest(
        layer=layer,
        hidden_states=tensor_pb2.Tensor(
            dtype=tensor_pb2.DATA_TYPE_BFLOAT16,
            shape=[tokens, hidden],
            data=bf16_bytes(tokens, hidden, seed),
        ),
        segments=[
            executor_pb2.Segment(num_tokens=n, adapter=adapters[i]) for i, n in enumerate(sizes)
        ],
    )


#: One round trip: the executor's server_time_us and output (0 and None for the echo).
Call = Callable[[], tuple[int, tensor_pb2.Tensor | None]]


def _unary_call(channel: grpc.Channel, target: str, request: executor_pb2.ForwardRequest) -> Call:
    if target == "echo":
        echo = channel.unary_unary(UNARY)
        payload = request.SerializeToString()

        def call_echo() -> tuple[int, tensor_pb2.Tensor | None]:
            echo(payload, timeout=60)
            return 0, None

        return call_echo
    stub = executor_pb2_grpc.ExecutorStub(channel)

    def call() -> tuple[int, tensor_pb2.Tensor | None]:
        response = stub.Forward(request, timeout=60)
        return int(response.server_time_us), response.output

    return call


class _StreamCall:
    """Sends one message on an open bidirectional stream and waits for its answer."""

    def __init__(
        self, channel: grpc.Channel, target: str, request: executor_pb2.ForwardRequest
    ) -> None:
        self._outbox: queue.Queue[object] = queue.Queue()
        self._echo = target == "echo"
        if self._echo:
            self._message: object = request.SerializeToString()
            self._answers: Iterator[object] = channel.stream_stream(STREAM)(self._requests())
        else:
            self._message = executor_pb2.ForwardStreamRequest(request_id=0, forward=request)
            stub = executor_pb2_grpc.ExecutorStub(channel)
            self._answers = stub.ForwardStream(self._requests())

    def _requests(self) -> Iterator[object]:
        while True:
            item = self._outbox.get()
            if item is None:
                return
            yield item

    def __call__(self) -> tuple[int, tensor_pb2.Tensor | None]:
        self._outbox.put(self._message)
        answer = next(self._answers)
        if self._echo:
            return 0, None
        assert isinstance(answer, executor_pb2.ForwardStreamResponse)
        if answer.HasField("error"):
            raise RuntimeError(f"{answer.error.code}: {answer.error.message}")
        return int(answer.forward.server_time_us), answer.forward.output

    def close(self) -> None:
        self._outbox.put(None)


class _Transport:
    """How a request's tensors travel: in the message (grpc), or in a region registered with
    the executor once — shared memory (shm) or CUDA memory on this process's GPU (cuda) —
    input written there once, the answer left there by the executor."""

    def __init__(
        self,
        channel: grpc.Channel,
        kind: str,
        target: str,
        request: executor_pb2.ForwardRequest,
        device: str = "cuda",
    ) -> None:
        self.request = request
        self._ring: Segment | None = None
        self._device: Any = None  # a moelora.client.cuda_ipc.DeviceBuffer (cuda)
        self._stub = executor_pb2_grpc.ExecutorStub(channel)
        self._registered = False
        self._channel: ForwardChannel | None = None
        self._network: Any = None  # a moelora.client.network_channel.NetworkChannel
        self._answer: Any = None  # the network channel's last output (a torch tensor)
        self._client_device = device
        if kind in ("grpc", "network"):
            return
        hidden = request.hidden_states
        nbytes = len(hidden.data)
        self._output_at = nbytes
        self._region = f"bench-{os.getpid()}"
        on_gpu = kind == "cuda" or (kind in ("channel", "spin") and _has_gpu())
        if not on_gpu:
            ring = self._ring = Segment.create_unique("moelora-bench", 2 * nbytes)
            ring.buffer[:nbytes] = hidden.data
            if target == "executor":
                self._stub.RegisterSharedMemory(
                    executor_pb2.RegisterSharedMemoryRequest(
                        region=self._region, shm_name=ring.name, size=ring.size
                    ),
                    timeout=60,
                )
                self._registered = True
        elif target == "executor":  # CUDA memory; the echo server needs none
            self._device = _device_copy(hidden.data, 2 * nbytes)
            self._stub.RegisterCudaMemory(
                executor_pb2.RegisterCudaMemoryRequest(
                    region=self._region,
                    ipc_handle=self._device.ipc_handle,
                    device_uuid=_device_uuid(),
                    size=self._device.nbytes,
                ),
                timeout=60,
            )
            self._registered = True

        def shared(offset: int) -> executor_pb2.SharedTensor:
            return executor_pb2.SharedTensor(
                region=self._region, offset=offset, dtype=hidden.dtype, shape=hidden.shape
            )

        self._template = tensor_pb2.Tensor(dtype=hidden.dtype, shape=hidden.shape)
        self.request = executor_pb2.ForwardRequest(
            layer=request.layer,
            segments=request.segments,
            shared_hidden_states=shared(0),
            shared_output=shared(nbytes),
        )

    def channel_call(self, spin: bool) -> Call:
        """Round trips over a direct channel to the engine (``--transport channel``): the
        request's descriptor, no gRPC call; ``spin`` (``--transport spin``): through the
        channel's spin block, polled by both ends."""
        opened = self._stub.OpenChannel(executor_pb2.OpenChannelRequest(), timeout=60)
        channel = self._channel = ForwardChannel(opened, timeout=60, spin=spin)
        if spin and channel.block is None:
            raise RuntimeError("the executor gave the channel no spin block (--channel-spin-us)")
        template = self.request
        ids = itertools.count(1)

        def call() -> tuple[int, tensor_pb2.Tensor | None]:
            result = channel.send(
                ForwardDescriptor(
                    request_id=next(ids),
                    layer=template.layer,
                    slot_wait=10.0,
                    decode_seconds=0.0,
                    scope="",
                    hidden=tensor_ref(template.shared_hidden_states),
                    output=tensor_ref(template.shared_output),
                    segments=tuple((s.num_tokens, s.adapter) for s in template.segments),
                )
            )
            raise_for(result.code, result.message, result.retry_after_ms)
            return result.server_time_us, None

        return call

    def network_call(self) -> Call:
        """Round trips over a network channel (``--transport network``): the descriptor over
        TCP, the tensors over the channel's process group from this process's ``--device``;
        each call ends with the output on the device, synchronised."""
        import torch

        from moelora.client.network_channel import NetworkChannel

        device = torch.device(self._client_device)
        torch.cuda.set_device(device)
        hidden = self.request.hidden_states
        rows = torch.frombuffer(bytearray(hidden.data), dtype=torch.bfloat16)
        tensor = rows.view(*hidden.shape).to(device)
        segments = [(s.num_tokens, s.adapter or None) for s in self.request.segments]
        opened = self._stub.OpenChannel(executor_pb2.OpenChannelRequest(network=True), timeout=60)
        channel = self._network = NetworkChannel(opened, device, timeout=60)

        def call() -> tuple[int, tensor_pb2.Tensor | None]:
            output, result = channel.forward(self.request.layer, tensor, segments)
            torch.cuda.current_stream(device).synchronize()
            self._answer = output
            return result.server_time_us, None

        return call

    def output(self, answered: tensor_pb2.Tensor | None) -> tensor_pb2.Tensor | None:
        """A copy of the call's output for the check: from the message, or from the region."""
        if self._network is not None:
            import torch

            data = self._answer.view(torch.int16).cpu().numpy().tobytes()
            return tensor_pb2.Tensor(
                dtype=self.request.hidden_states.dtype,
                shape=self.request.hidden_states.shape,
                data=data,
            )
        if not self._registered:
            return answered
        end = 2 * self._output_at
        if self._ring is not None:
            data = bytes(self._ring.buffer[self._output_at : end])
        else:
            data = self._device.tensor[self._output_at : end].cpu().numpy().tobytes()
        return tensor_pb2.Tensor(dtype=self._template.dtype, shape=self._template.shape, data=data)

    def __enter__(self) -> _Transport:
        return self

    def __exit__(self, *_exc: object) -> None:
        if self._channel is not None:
            self._channel.close()
        if self._network is not None:
            self._network.close()
        if self._registered:
            unregister = (
                self._stub.UnregisterSharedMemory
                if self._ring is not None
                else self._stub.UnregisterCudaMemory
            )
            request_type = (
                executor_pb2.UnregisterSharedMemoryRequest
                if self._ring is not None
                else executor_pb2.UnregisterCudaMemoryRequest
            )
            with contextlib.suppress(grpc.RpcError):
                unregister(request_type(region=self._region), timeout=10)
        if self._ring is not None:
            self._ring.close()
        if self._device is not None:
            self._device.close()


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def _device_copy(data: bytes, nbytes: int) -> Any:
    """A CUDA IPC-exportable buffer of ``nbytes`` on this process's GPU, ``data`` at its start
    (torch is imported only by cuda clients)."""
    import torch

    from moelora.client.cuda_ipc import DeviceBuffer

    buffer = DeviceBuffer(nbytes, torch.device("cuda"))
    buffer.tensor[: len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    torch.cuda.synchronize()
    return buffer


def _device_uuid() -> str:
    import torch

    from moelora.client.cuda_ipc import device_uuid

    return device_uuid(torch.device("cuda"))


def _row_errors(kept: list[tensor_pb2.Tensor | None], expected: Path | None) -> list[float]:
    """The worst row error of each kept answer against ``expected`` (none without it)."""
    if expected is None:
        return []
    reference = np.load(expected)
    return [
        math.inf if output is None else worst_row_error(tensor_to_float32(output), reference)
        for output in kept
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--address", required=True)
    parser.add_argument("--target", choices=["executor", "echo"], default="executor")
    parser.add_argument("--mode", choices=["unary", "stream"], default="unary")
    parser.add_argument("--layer", type=int, default=0)
    parser.add_argument("--tokens", type=int, required=True)
    parser.add_argument("--hidden", type=int, required=True)
    parser.add_argument("--adapters", default="", help="comma list of adapter references")
    parser.add_argument("--iters", type=int, default=100, help="0: until 'stop' on stdin")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--expected", type=Path, help="the answer to check against (.npy)")
    parser.add_argument("--tolerance", type=float, default=0.0)
    parser.add_argument(
        "--transport",
        choices=["grpc", "shm", "cuda", "channel", "spin", "network"],
        default="grpc",
        help="shm / cuda: the tensors in a shared-memory / CUDA-memory region registered once, "
        "the RPC a descriptor; channel: that region (CUDA memory where this process has a GPU) "
        "and the descriptor over a direct channel to the engine, no RPC per call; spin: the "
        "same through the channel's spin block; network: a network channel from --device "
        "(NCCL), no RPC per call",
    )
    parser.add_argument("--device", default="cuda", help="the tensors' GPU (--transport network)")
    args = parser.parse_args(argv)
    adapters = [a for a in args.adapters.split(",") if a]
    request = forward_request(args.layer, args.tokens, args.hidden, adapters, args.seed)
    with (
        grpc.insecure_channel(args.address, options=_OPTIONS) as channel,
        _Transport(channel, args.transport, args.target, request, args.device) as transport,
    ):
        request = transport.request
        stream = None
        if args.transport in ("channel", "spin") and args.target == "executor":
            # One kind of call: the mode does not apply.
            sent = transport.channel_call(args.transport == "spin")
        elif args.transport == "network" and args.target == "executor":
            sent = transport.network_call()
        elif args.mode == "stream":
            sent = stream = _StreamCall(channel, args.target, request)
        else:
            sent = _unary_call(channel, args.target, request)

        kept: list[tensor_pb2.Tensor | None] = [
            transport.output(sent()[1]) for _ in range(args.warmup)
        ]
        print("ready", flush=True)
        if sys.stdin.readline().strip() != "go":
            return
        latency: list[float] = []
        server: list[int] = []
        stop = threading.Event()

        def wait_for_stop() -> None:
            sys.stdin.readline()
            stop.set()

        if not args.iters:  # until "stop" on stdin
            threading.Thread(target=wait_for_stop, daemon=True).start()
        start, cpu = time.time(), time.process_time()
        started: list[float] = []
        while (len(latency) < args.iters) if args.iters else not stop.is_set():
            started.append(time.time())
            begin = time.perf_counter()
            server_us, output = sent()
            latency.append(time.perf_counter() - begin)
            server.append(server_us)
            if len(latency) % CHECK_EVERY == 1:  # copied out after the call's time is taken
                kept.append(transport.output(output))
        end, cpu = time.time(), time.process_time() - cpu
        if stream is not None:
            stream.close()
    errors = _row_errors(kept, args.expected)
    print(
        json.dumps(
            {
                "latency_s": latency,
                "server_us": server,
                "started": started,
                "start": start,
                "end": end,
                "cpu_s": cpu,
                "checked": len(errors),
                "worst_row_error": max(errors, default=0.0),
                "mismatched": sum(1 for e in errors if not e <= args.tolerance),
            }
        )
    )


if __name__ == "__main__":
    main()
