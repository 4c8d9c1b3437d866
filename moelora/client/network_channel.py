"""A network channel to an executor's engine, for a client on another host or GPU: Forward with
the tensors moved GPU to GPU and only a small descriptor over TCP, no gRPC call each.

``ExecutorClient.open_network_channel()`` asks for a ticket over gRPC once (auth, scope and
leases as for every call). The channel then connects to the engine over TCP, presents the
ticket, and joins a two-rank torch.distributed process group with the engine through its
rendezvous store (``moelora.client.network_group``): NCCL between GPUs, Gloo with a CPU
executor. Per call it sends the descriptor, then the input over the group, receives the
output over the group and the RESULT frame over TCP. One request is in flight at a time (open
one channel per thread).

A client in another language speaks the same frames as a direct channel (docs/api.md) and
joins the group as torch.distributed's rank 1 does: the NCCL unique id under the store key
prefix ``channel/<ticket>/``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import socket
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from moelora.client import network_group
from moelora.client.channel import last_words
from moelora.client.engine_wire import (
    Connection,
    ForwardDescriptor,
    ForwardResult,
    Kind,
    TensorRef,
    raise_for,
)
from moelora.client.errors import DeadlineExceeded, FailedPrecondition, Unavailable
from moelora.client.tensors import dtype_from_name
from moelora.v1 import executor_pb2

if TYPE_CHECKING:
    import torch

#: (num_tokens, adapter reference or None for the base model), in token order.
Segments = Sequence[tuple[int, str | None]]


class NetworkChannel:
    """A connected network channel (``ExecutorClient.open_network_channel``) whose tensors are
    on ``device``. ``timeout``: how long one call may take; ``slot_wait``: how long the
    engine may hold a request for GPU slots (capped by the executor's own limit)."""

    def __init__(
        self,
        opened: executor_pb2.OpenChannelResponse,
        device: torch.device,
        timeout: float = 30.0,
        slot_wait: float = 10.0,
    ) -> None:
        check_backend(opened, device)
        host, _, port = opened.network_address.rpartition(":")
        try:
            sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
        except OSError as exc:
            raise FailedPrecondition(
                f"channel: cannot reach the engine at {opened.network_address} ({exc}); the "
                "executor's --network-channel-port must be reachable from this host",
                "channel",
            ) from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._connection = Connection(sock)
        self.device = device
        self.leased = list(opened.leased)
        self.slot_wait = slot_wait
        self.serving = True
        self.reason = ""
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._transfers: Transfers | None = None
        try:
            self._connection.send_json(Kind.HELLO, {"ticket": opened.ticket, "pid": os.getpid()})
            self._admitted()
        except (EOFError, OSError):
            sock.close()
            raise Unavailable(
                f"channel: the engine turned it away ({self.reason or 'it hung up'})"
            ) from None
        try:
            self._transfers = Transfers.join(opened, device)
        except Unavailable:
            sock.close()
            raise

    def forward(
        self, layer: int, hidden: torch.Tensor, segments: Segments | None = None
    ) -> tuple[torch.Tensor, ForwardResult]:
        """One MoE layer for ``hidden`` (T, H) on the channel's device: the output (a new
        tensor, ready on the current stream) and the engine's result. Errors raise as for
        Forward."""
        transfers = self._transfers
        if transfers is None:
            raise Unavailable("channel: closed")
        with self._lock:
            descriptor, hidden = network_descriptor(
                self.device, layer, hidden, segments, next(self._ids), self.slot_wait
            )
            try:
                self._connection.send(Kind.FORWARD, descriptor.encode())
                output, receiving = transfers.post(hidden)
                result = self._result(descriptor.request_id)
                receiving.wait()  # NCCL: the current stream waits; Gloo: this thread does
            except TimeoutError:
                self._broken()
                raise DeadlineExceeded("channel: no answer within the channel's timeout") from None
            except (EOFError, OSError, RuntimeError):
                self._broken()
                raise Unavailable(
                    f"channel: the engine closed it ({self.reason or 'it stopped'}); open another"
                ) from None
        raise_for(result.code, result.message, result.retry_after_ms)
        return output, result

    def _admitted(self) -> None:
        """Reads the engine's states until it takes the ticket (EOFError if it hangs up)."""
        while True:
            kind, payload = self._connection.recv()
            if kind is Kind.STATE:
                state: dict[str, Any] = json.loads(payload)
                self.serving, self.reason = bool(state["serving"]), str(state["reason"])
                if state.get("admitted"):
                    return

    def _result(self, request_id: int) -> ForwardResult:
        while True:
            kind, payload = self._connection.recv()
            if kind is Kind.RESULT:
                result = ForwardResult.decode(payload)
                if result.request_id == request_id:
                    return result
            elif kind is Kind.STATE:
                state: dict[str, Any] = json.loads(payload)
                self.serving, self.reason = bool(state["serving"]), str(state["reason"])

    def _broken(self) -> None:
        """After a failed call the two ends' transfers no longer pair up: the channel ends
        (reading the reason the engine gave, if any)."""
        last = last_words(self._connection)
        if last is not None:
            self.serving, self.reason = last
        self.close()

    def close(self) -> None:
        """Closes the socket and ends the group (the engine frees the channel's buffers)."""
        with contextlib.suppress(OSError):
            self._connection.close()
        transfers, self._transfers = self._transfers, None
        if transfers is not None:
            transfers.close()

    def __enter__(self) -> NetworkChannel:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


class Transfers:
    """A network channel's client end of its group (rank 1): one request's tensors at a time,
    input sent then output received (``moelora.client.network_group``)."""

    def __init__(self, group: network_group.Group, store: Any, device: torch.device) -> None:
        self._group = group
        self._store = store  # the group reads it while it makes its communicator
        self._device = device
        self._sending: Any = None

    @classmethod
    def join(cls, opened: executor_pb2.OpenChannelResponse, device: torch.device) -> Transfers:
        """Joins the channel's group once the engine admitted the ticket: the first transfer
        completes the rendezvous (blocking; Unavailable if it fails)."""
        import torch

        try:
            store = network_group.store_client(opened.store_address)
            group = network_group.channel_group(
                store, opened.ticket, network_group.CLIENT_RANK, opened.backend
            )
            transfers = cls(group, store, device)
            hello = torch.zeros(network_group.HELLO_BYTES, dtype=torch.uint8, device=device)
            transfers._send(hello).wait()
        except Exception as exc:  # torch.distributed's errors
            raise Unavailable(f"channel: the rendezvous with the engine failed ({exc})") from None
        return transfers

    def post(self, hidden: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Posts the input's send and the output's receive (after the frame that describes
        them): the output tensor and the receive (``wait`` it once the RESULT is read)."""
        import torch

        if self._sending is not None:  # done by now: the engine answered the request before
            self._sending.wait()
        self._sending = self._send(hidden)
        output = torch.empty_like(hidden)
        receiving = self._group.recv(
            [network_group.as_bytes(output)], network_group.ENGINE_RANK, network_group.TAG
        )
        return output, receiving

    def _send(self, tensor: torch.Tensor) -> Any:
        return self._group.send(
            [network_group.as_bytes(tensor)], network_group.ENGINE_RANK, network_group.TAG
        )

    def close(self) -> None:
        network_group.abort(self._group)


def check_backend(opened: executor_pb2.OpenChannelResponse, device: torch.device) -> None:
    """FailedPrecondition unless tensors on ``device`` can use the channel's backend."""
    if network_group.backend_for(device) != opened.backend:
        raise FailedPrecondition(
            f"device: the executor's channels use {opened.backend}, which {device} cannot "
            "(NCCL for CUDA tensors, Gloo for CPU tensors)",
            "device",
        )


def network_descriptor(
    device: torch.device,
    layer: int,
    hidden: torch.Tensor,
    segments: Segments | None,
    request_id: int,
    slot_wait: float,
) -> tuple[ForwardDescriptor, torch.Tensor]:
    """The descriptor of one request (its tensors' dtype and shape alone) and the input as
    the group sends it (contiguous); ValueError for a tensor the channel does not carry."""
    if hidden.device != device or hidden.dim() != 2:
        raise ValueError(f"hidden: must be (T, H) on {device}")
    name = str(hidden.dtype).removeprefix("torch.")
    if name not in _FLOATS:
        raise ValueError(f"hidden: {hidden.dtype} is not float32, float16 or bfloat16")
    hidden = hidden.contiguous()
    shape = tuple(int(d) for d in hidden.shape)
    ref = TensorRef("", 0, math.prod(shape) * hidden.element_size(), dtype_from_name(name), shape)
    descriptor = ForwardDescriptor(
        request_id=request_id,
        layer=layer,
        slot_wait=slot_wait,
        decode_seconds=0.0,
        scope="",  # the engine takes the ticket's
        hidden=ref,
        output=ref,
        segments=tuple((n, a or "") for n, a in segments or ()),
    )
    return descriptor, hidden


_FLOATS = ("float32", "float16", "bfloat16")
