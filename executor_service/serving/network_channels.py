"""Network channels: Forward for clients on other hosts (or other GPUs), with the tensors moved
GPU to GPU and only descriptors over TCP.

A client calls ``OpenChannel{network: true}`` (gRPC: auth, scope and leases as for a direct
channel) and gets a ticket, the engine's TCP address and the address of the engine's rendezvous
store. It connects over TCP and speaks a direct channel's frames (HELLO with the ticket, then
FORWARD descriptors, reading RESULT and STATE), while the tensors travel over a two-rank
torch.distributed process group of the channel's own (``moelora.client.network_group``): NCCL
between GPUs (NVLink on one host; InfiniBand or RoCE with GPUDirect RDMA, else sockets, across
hosts), Gloo when the executor computes on the CPU. A descriptor gives only the tensors' dtype
and shape. One request at a time, in this order:

    client                                engine
    FORWARD descriptor   ── TCP ──▶       reads it, checks its size
    send(input)          ── group ──▶     receives it into the channel's buffer (its memory)
    recv(output)                          launches it as a request in device memory
                         ◀── group ──     send(output): also when the answer is an error
                         ◀── TCP ──       RESULT

A descriptor that would break that pairing (a size the engine will not receive, routing, a
second request in flight) ends the channel: its transfers could no longer pair up.

The engine waits for a channel's input on the channel's reader thread, never on the launch
loop: a client that sends a descriptor and no tensor holds its own channel alone, until it
closes its socket (the wait notices) or the transfer times out.
"""

from __future__ import annotations

import contextlib
import logging
import math
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import replace

import torch
from torch._C._distributed_c10d import TCPStore, Work

from executor_service.serving.regions import HeldRegion, RegionInfo
from moelora.client import network_group
from moelora.client.engine_wire import ForwardDescriptor, TensorRef
from moelora.client.logs import log_event
from moelora.client.tensors import WIRE_TYPES

log = logging.getLogger(__name__)

#: How long the engine waits for a channel's input after its descriptor, and for the
#: client's side of the rendezvous after its HELLO.
RECEIVE_TIMEOUT_SECONDS = 30.0


class ChannelBroken(ValueError):
    """The channel's transfers can no longer pair up (or its peer is gone): it ends."""


class NetworkChannels:
    """The engine's TCP listener for network channels and its rendezvous store."""

    def __init__(
        self, bind_host: str, port: int, advertise_host: str, max_channels: int, buffer_bytes: int
    ) -> None:
        self.listener = socket.create_server((bind_host, port), backlog=64)
        self.max_channels = max_channels
        self._buffer_bytes = buffer_bytes
        self._store = TCPStore(
            bind_host,
            0,
            is_master=True,
            wait_for_workers=False,
            timeout=network_group.GROUP_TIMEOUT,
            use_libuv=True,
        )
        self.address = f"{advertise_host}:{self.listener.getsockname()[1]}"
        self.store_address = f"{advertise_host}:{self._store.port}"

    def data_link(self, ticket: str, device: torch.device) -> DataLink:
        """The engine's end of the channel ``ticket`` names, on ``device``."""
        backend = network_group.backend_for(device)
        group = network_group.channel_group(self._store, ticket, network_group.ENGINE_RANK, backend)
        return DataLink(group, device, self._buffer_bytes)

    def close(self) -> None:
        self.listener.close()


class DataLink:
    """One network channel's tensors: its group and the device buffer its requests' input and
    output live in (grown to the largest request, up to ``buffer_bytes`` for both)."""

    def __init__(self, group: network_group.Group, device: torch.device, buffer_bytes: int) -> None:
        self._group = group
        self._device = device
        self._buffer_bytes = buffer_bytes
        self._cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if self._cuda else None  # type: ignore[no-untyped-call]
        self.region = _region(device, 0)
        self._output_bytes = -1  # -1: no request received and unanswered
        self._output_at = 0
        self._sending: Work | None = None
        self._lock = threading.Lock()
        self._peer_gone: Callable[[], bool] = lambda: False

    def connect(self, peer_gone: Callable[[], bool]) -> None:
        """Completes the rendezvous: receives the client's first transfer (``HELLO_BYTES``);
        every wait of the channel watches ``peer_gone``."""
        self._peer_gone = peer_gone
        hello = torch.zeros(network_group.HELLO_BYTES, dtype=torch.uint8, device=self._device)
        self._receive(hello)

    def receive(self, payload: bytes) -> bytes:
        """Receives the input of the descriptor ``payload`` into the buffer; the descriptor,
        pointing at the buffer, as the engine takes it. ChannelBroken if it cannot."""
        if self._output_bytes >= 0:
            raise ChannelBroken("a network channel carries one request at a time")
        descriptor = ForwardDescriptor.decode(payload)
        hidden = descriptor.hidden
        if descriptor.topk_ids is not None or descriptor.topk_weights is not None:
            raise ChannelBroken("a network channel carries no routing")
        wire = WIRE_TYPES.get(hidden.dtype)  # type: ignore[call-overload]
        if wire is None or any(d < 0 for d in hidden.shape):
            raise ChannelBroken("the descriptor's input has no dtype or shape the engine takes")
        nbytes = math.prod(hidden.shape) * wire.itemsize
        output_at = -(-nbytes // 256) * 256  # the output aligned after the input
        if output_at + nbytes > self._buffer_bytes:
            raise ChannelBroken(
                f"the descriptor's input and output take {output_at + nbytes} bytes, more "
                f"than the {self._buffer_bytes} a network channel holds "
                "(--network-channel-buffer-bytes): send fewer tokens per request"
            )
        with self._lock:
            if self._sending is not None:  # done by now: the client saw it before this
                self._sending.wait()
                self._sending = None
            if self.region.info.size < output_at + nbytes:
                try:
                    self.region = _region(self._device, output_at + nbytes)
                except torch.OutOfMemoryError:
                    raise ChannelBroken(
                        f"the device has no {output_at + nbytes} bytes free for the channel's "
                        "buffer"
                    ) from None
        self._receive(self.region.memory.bytes[:nbytes])
        self._output_bytes = nbytes
        self._output_at = output_at
        return replace(
            descriptor,
            hidden=TensorRef(self.region.info.region, 0, nbytes, hidden.dtype, hidden.shape),
            output=TensorRef(
                self.region.info.region, output_at, nbytes, hidden.dtype, hidden.shape
            ),
        ).encode()

    def send_output(self) -> None:
        """Sends the answered request's output (whatever the buffer holds if it failed), on
        the launch loop once the launch is synchronised, before its RESULT frame."""
        if self._output_bytes < 0:
            return
        at, nbytes = self._output_at, self._output_bytes
        self._output_bytes = -1
        with self._lock, self._on_stream():
            self._sending = self._group.send(
                [self.region.memory.bytes[at : at + nbytes]],
                network_group.CLIENT_RANK,
                network_group.TAG,
            )

    def _receive(self, into: torch.Tensor) -> None:
        with self._on_stream():
            work = self._group.recv([into], network_group.CLIENT_RANK, network_group.TAG)
            try:
                if self._cuda:  # Gloo's receive completes in ``wait``; NCCL's is polled
                    _poll(work, self._peer_gone)
                work.wait()
            except RuntimeError as exc:  # torch.distributed's errors (a peer gone, a timeout)
                raise ChannelBroken(f"the client's tensor did not arrive ({exc})") from None

    def _on_stream(self) -> contextlib.AbstractContextManager[object]:
        if self._stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self._stream)

    def close(self) -> None:
        """Ends the group (transfers in flight end with it)."""
        network_group.abort(self._group)


def _poll(work: Work, peer_gone: Callable[[], bool]) -> None:
    """Waits for a transfer, watching the peer: one that hung up never completes it."""
    deadline = time.monotonic() + RECEIVE_TIMEOUT_SECONDS
    spins = 0
    while not work.is_completed():
        spins += 1
        if spins % 64 == 0:
            if peer_gone():
                raise ChannelBroken("the client went away before its tensor arrived")
            if time.monotonic() > deadline:
                raise ChannelBroken(
                    f"the client's tensor did not arrive within {RECEIVE_TIMEOUT_SECONDS:.0f} s"
                )
        time.sleep(0 if spins < 2048 else 0.0002)


def peer_gone(sock: socket.socket) -> Callable[[], bool]:
    """Whether the client at the other end of ``sock`` hung up (or its connection broke),
    bytes it sent still unread or not."""
    poller = select.poll()  # not select(): the engine's descriptors may pass FD_SETSIZE
    poller.register(sock, _HUNG_UP)

    def gone() -> bool:
        return any(events & _HUNG_UP for _, events in poller.poll(0))

    return gone


#: poll()'s events for a peer that closed its end (RDHUP: even with its last bytes unread).
_HUNG_UP = select.POLLRDHUP | select.POLLHUP | select.POLLERR


def _region(device: torch.device, size: int) -> HeldRegion:
    info = RegionInfo("network-channel", "network", size)
    return HeldRegion(info, _Buffer(torch.empty(size, dtype=torch.uint8, device=device)))


class _Buffer:
    """A network channel's memory: the engine's own (nothing to unmap)."""

    pinned = 0

    def __init__(self, data: torch.Tensor) -> None:
        self.bytes = data

    def close(self) -> None:
        pass


def advertised_host(setting: str | None) -> str:
    """The host clients are told to reach the engine at (see ``network_channel_host``)."""
    if setting:
        return setting
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        log_event(log, "network_channel_host_unresolved", logging.WARNING)
        return "127.0.0.1"
