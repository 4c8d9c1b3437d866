"""The engine's side of the serving split: where front ends' requests reach the GPU's owner.

Front ends connect over a local socket (a Unix socket path, or one end of a socket pair when
the front end runs in the engine's process), introduce the shared-memory arena their requests'
tensors live in (HELLO), then send Forward descriptors and admin calls. One reader thread per
front end receives them and posts each Forward to the scheduler's launch loop, which views the
request's tensors in shared memory (no copy), checks and prepares it when that waits on nothing
(``ForwardEngine.prepare_at_once``), merges it with others, writes its answer straight into the
front end's output region and sends the result back, all on that one thread. A request whose
adapters must first be asked for, fetched or packed is prepared on a worker thread and then
queued. Admin calls (load, pin, list, info) run on the workers against the ``AdapterManager``.

The engine speaks no gRPC and no protobuf: statuses travel as ``grpc.StatusCode`` numbers with
the domain error's message, everything else as the small structs of ``wire`` and JSON. A front
end that goes away takes nothing with it: its requests in flight finish and their answers are
dropped, and its arena's mapping is released once none of them holds a view of it. One that
stops reading is cut off after ``SEND_TIMEOUT_SECONDS``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
import secrets
import shutil
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import torch

from executor_service.adapters import AdapterStatus, HeldAdapters
from executor_service.batch import Prepared, Segment
from executor_service.engine import ForwardInput, ForwardOutput
from executor_service.registry_source import registry_status
from executor_service.runtime import ExecutorRuntime, replica_name
from executor_service.serving.network_channels import (
    DataLink,
    NetworkChannels,
    advertised_host,
    peer_gone,
)
from executor_service.serving.regions import HeldRegion, HostPinning, RegionInfo, SharedRegions
from executor_service.serving.spin_poller import SpinEntry, SpinPoller
from moelora.client import network_group
from moelora.client.cuda_ipc import CudaError, register_host, unregister_host
from moelora.client.engine_wire import (
    MAX_FRAME,
    Connection,
    ForwardDescriptor,
    ForwardResult,
    Kind,
    TensorRef,
    frame,
)
from moelora.client.errors import (
    FailedPrecondition,
    InvalidArgument,
    MoeLoraError,
    Overloaded,
    ResourceExhausted,
    Unavailable,
)
from moelora.client.logs import log_event
from moelora.client.shared_memory import Segment as ShmSegment
from moelora.client.spin_block import ANSWER_BYTES
from moelora.client.tensors import MAX_DIMS, MAX_ELEMENTS, WIRE_TYPES
from shared.grpc_server import internal_error_message
from shared.refs import AdapterRef
from shared.version import package_version

log = logging.getLogger(__name__)

_OK = grpc.StatusCode.OK.value[0]

#: Direct channels open at once (each holds a reader thread).
MAX_CHANNELS = 1024
#: How long a new channel may take to present its ticket.
HELLO_TIMEOUT_SECONDS = 5.0
#: The longest frame a channel may send: a descriptor of 16,384 one-token segments with
#: 40-character adapter references fits; a peer cannot make the engine buffer more.
CHANNEL_MAX_FRAME = 1024 * 1024

#: How long a send to a front end may block before the engine gives that front end up: the
#: launch loop answers every front end, so one that stops reading (stopped, wedged) must not
#: stall the others' answers.
SEND_TIMEOUT_SECONDS = 5.0


class EngineHost:
    """Serves front ends' requests with the runtime attached once the model loaded; until
    then (and after ``set_state(False, ...)``) every request answers UNAVAILABLE."""

    def __init__(
        self,
        workers: int,
        send_timeout: float = SEND_TIMEOUT_SECONDS,
        pinned_bytes: int = 0,
        region_pinned_bytes: int = 0,
        spin_seconds: float = 0.0,
        max_spin_channels: int = 64,
    ) -> None:
        self._send_timeout = send_timeout
        #: How much of each front end's arena to page-lock on a GPU (its requests' rows are
        #: then read and written by the device in place).
        self._pinned_bytes = pinned_bytes
        #: The same for clients' shared-memory regions, all of them together.
        self._region_pinned_bytes = region_pinned_bytes
        #: Page-locks regions as they are registered (on a GPU, once the runtime is attached).
        self.region_pinning: HostPinning | None = None
        self._runtime: ExecutorRuntime | None = None
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="engine")
        self._lock = threading.Lock()
        self._links: set[_Link] = set()
        self._serving = False
        self._reason = "the executor is still loading its base model"
        self._listener: socket.socket | None = None
        self._closed = threading.Event()
        #: Clients' registered shared memory (same-host requests without their bytes).
        self.regions = SharedRegions()
        self._channels: _Channels | None = None
        self._network: NetworkChannels | None = None
        #: Digests held in GPU slots by channels' leases (a count per lease holding each).
        self._leased: collections.Counter[str] = collections.Counter()
        #: Channels' spin blocks, polled by the launch loop (None: channels do not spin).
        self._spin: SpinPoller[_Link] | None = (
            SpinPoller(spin_seconds, self._spun, max_spin_channels)
            if spin_seconds > 0 and max_spin_channels > 0
            else None
        )

    @property
    def runtime(self) -> ExecutorRuntime | None:
        return self._runtime

    def attach(self, runtime: ExecutorRuntime) -> None:
        device = runtime.placement.device
        if device.type == "cuda" and self._region_pinned_bytes:
            self.region_pinning = HostPinning(device, self._region_pinned_bytes)
        self._runtime = runtime
        if self._spin is not None:
            runtime.scheduler.poll_while_idle(self._spin)
        self._count_channels()  # both kinds' series from the start, at 0
        with self._lock:
            links = list(self._links)
        for link in links:
            self._pin(link)

    def _pin(self, link: _Link) -> None:
        """Page-locks the start of a front end's arena for the runtime's GPU, if there is
        one (before its first request: at HELLO, or at ``attach`` for earlier front ends)."""
        runtime = self._runtime
        if runtime is None or runtime.placement.device.type != "cuda":
            return  # a channel has no arena: ``pin`` does nothing for it
        link.pin(self._pinned_bytes, runtime.placement.device)

    def set_state(self, serving: bool, reason: str = "") -> None:
        """Tells every front end whether to report SERVING (and why not)."""
        with self._lock:
            self._serving, self._reason = serving, reason
            links = list(self._links)
        for link in links:
            link.send_state(serving, reason)

    # -- connections -------------------------------------------------------------------------

    def listen(self, path: Path) -> None:
        """Accepts front ends on the Unix socket ``path`` (separate processes)."""
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        path.unlink(missing_ok=True)
        listener.bind(str(path))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, name="engine-accept", daemon=True).start()

    def listen_channels(
        self, directory: Path | None, max_in_flight: int, max_per_token: int
    ) -> Path:
        """Accepts same-host clients' direct channels on a Unix socket in ``directory`` (a
        private temporary one when None); returns its path. A client gets in with a ticket
        from ``OpenChannel`` (its caller's scope) and may then only send Forward descriptors
        naming its registered regions, at most ``max_in_flight`` at a time. A token's scope
        holds at most ``max_per_token`` channels and unused tickets (of both kinds)."""
        channels = _Channels(directory, max_in_flight, max_per_token, self._release)
        self._channels = channels
        threading.Thread(
            target=self._accept, args=(channels.listener, True), name="engine-channels", daemon=True
        ).start()
        return channels.path

    def listen_network_channels(
        self, port: int | None, advertise: str | None, max_channels: int, buffer_bytes: int
    ) -> None:
        """Accepts network channels (``network_channels``) on TCP ``port`` of every
        interface (0: any free port; None: none), told to clients as ``advertise``; each
        holds at most ``buffer_bytes`` of device memory for its requests."""
        if port is None:
            return
        network = NetworkChannels(
            "0.0.0.0", port, advertised_host(advertise), max_channels, buffer_bytes
        )
        self._network = network
        threading.Thread(
            target=self._accept,
            args=(network.listener, True, True),
            name="engine-network-channels",
            daemon=True,
        ).start()

    def open_channel(
        self,
        scope: str,
        adapters: list[str] | None = None,
        wait: float = 0.0,
        network: bool = False,
    ) -> dict[str, Any]:
        """A ticket to a direct channel for ``scope``'s caller (see ``listen_channels``;
        ``network``: a network channel, see ``listen_network_channels``), ``adapters`` leased
        for it (held in GPU slots, waiting up to ``wait`` for them, until the channel closes,
        or the ticket expires unused)."""
        channels = self._channels
        if channels is None:
            raise FailedPrecondition("this executor takes no direct channels", "channel")
        extra: dict[str, Any] = {}
        if network:
            if self._network is None:
                raise FailedPrecondition(
                    "network: this executor takes no network channels (--network-channel-port "
                    "unset); send the tensors' bytes",
                    "network",
                )
            extra = {
                "network_address": self._network.address,
                "store_address": self._network.store_address,
                "backend": network_group.backend_for(self._ready().placement.device),
            }
        with self._lock:
            open_now = sum(link.channel and link.scope == scope for link in self._links)
        with channels.place(scope, open_now):  # before the lease: a refusal loads nothing
            held = self._hold(
                [AdapterRef.parse(a, f"adapters[{i}]") for i, a in enumerate(adapters or [])],
                wait,
            )
            ticket = channels.ticket(scope, held, network)
        ticket["leased"] = [] if held is None else [a.label for a in held.adapters]
        return {**ticket, **extra}

    def _hold(self, refs: list[AdapterRef], wait: float) -> HeldAdapters | None:
        """``refs`` held in GPU slots for a channel, if leases leave a slot for the rest."""
        if not refs:
            return None
        runtime = self._ready()
        manager = runtime.adapters
        with runtime.device.guard():
            digests = {manager.resolve(ref).digest for ref in refs}
            with self._lock:
                # A lease on a pinned adapter takes no slot that pinning had not taken already.
                leased = (set(self._leased) | digests) - manager.slots.pinned_digests()
                stats = manager.stats()
                if len(leased) + stats.pinned_slots >= stats.num_slots:
                    raise ResourceExhausted(
                        f"adapters: leasing them would hold {len(leased)} of {stats.num_slots} "
                        f"GPU slots for channels besides {stats.pinned_slots} pinned; one must "
                        "stay for other requests: lease fewer, or close channels",
                        "adapters",
                    )
                self._leased.update(digests)
            try:
                return manager.hold(refs, wait)
            except BaseException:
                self._forget(digests)
                raise

    def _release(self, held: HeldAdapters | None) -> None:
        """Ends a channel's lease (its channel closed, or its ticket expired unused)."""
        runtime = self._runtime
        if held is None or runtime is None:
            return
        try:
            with runtime.device.guard():
                runtime.adapters.release(held)
        except Exception:  # stopping, or a device fault: the slots go with the process
            log_event(log, "channel_lease_release_failed", logging.WARNING, exc_info=True)
        self._forget(held.digests)

    def _forget(self, digests: Iterable[str]) -> None:
        with self._lock:
            self._leased.subtract(digests)
            self._leased = +self._leased  # drop the zeros

    def network_channels_open(self) -> int:
        """Network channels connected now (admitted or not)."""
        with self._lock:
            return sum(link.network for link in self._links)

    def _accept(
        self, listener: socket.socket | None = None, channel: bool = False, network: bool = False
    ) -> None:
        listener = listener or self._listener
        assert listener is not None
        while not self._closed.is_set():
            try:
                sock, _ = listener.accept()
            except OSError:
                return
            if network:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.serve(sock, channel, network)

    def serve(self, sock: socket.socket, channel: bool = False, network: bool = False) -> None:
        """Serves the front end (or, ``channel``, the client; ``network``, over TCP) at the
        other end of ``sock``."""
        link = _Link(Connection(sock), self._send_timeout, channel, network)
        limit = MAX_CHANNELS
        if network:
            assert self._network is not None
            limit = self._network.max_channels
        with self._lock:
            open_now = sum(x.channel and x.network == network for x in self._links)
            crowded = channel and open_now >= limit
            if not crowded:
                self._links.add(link)
            serving, reason = self._serving, self._reason
        if crowded:  # each channel holds a reader thread: a bound, not a pile of threads
            kind = "network channels" if network else "channels"
            link.send_state(False, f"{limit} {kind} are open, the most the engine takes")
            link.close()
            return
        link.send_state(serving, reason)
        if channel:
            self._count_channels()
        threading.Thread(target=self._read, args=(link,), name="engine-link", daemon=True).start()

    def _count_channels(self) -> None:
        """The channels-open gauge, by kind (once the runtime, and its metrics, are there)."""
        runtime = self._runtime
        if runtime is None:
            return
        with self._lock:
            network = sum(link.network for link in self._links)
            spin = sum(link.spin is not None for link in self._links)
            direct = sum(link.channel for link in self._links) - network - spin
        runtime.metrics.channels_open.labels("direct").set(direct)
        runtime.metrics.channels_open.labels("spin").set(spin)
        runtime.metrics.channels_open.labels("network").set(network)

    def _read(self, link: _Link) -> None:
        try:
            while True:
                kind, payload = link.connection.recv(link.max_frame)
                if kind is Kind.BELL and link.spin is not None:
                    self._ring()
                elif kind is Kind.FORWARD and link.ready and link.spin is None:
                    received = time.perf_counter()
                    if link.data is not None:  # its input arrives over the channel's group
                        payload = link.data.receive(payload)
                    if not link.enter():
                        self._finish(link, _Borrowed(), self._overloaded(link, payload))
                        continue
                    self._dispatch(link, payload, received)
                elif kind is Kind.CALL and not link.channel:
                    self._pool.submit(self._call, link, payload)
                elif kind is Kind.HELLO and link.channel:
                    if not self._admit(link, json.loads(payload)):
                        return
                elif kind is Kind.HELLO:
                    link.hello(json.loads(payload))
                    self._pin(link)
                else:
                    raise ValueError(f"unexpected frame {kind.name} from a peer")
        except (EOFError, OSError):
            pass  # the peer went away
        except ValueError as exc:
            if not link.channel:
                internal_error_message("engine_link_failed", front_end=link.pid)
            else:  # a client that broke the protocol: its channel ends, nothing else
                log_event(
                    log, "channel_refused", logging.WARNING, pid=link.pid, error=str(exc)[:200]
                )
                link.send_state(False, f"the channel ended: {str(exc)[:200]}")
        except Exception:
            internal_error_message("engine_link_failed", front_end=link.pid)
        finally:
            with self._lock:
                self._links.discard(link)
            if link.channel:
                self._count_channels()
            if link.spin is not None and self._spin is not None:
                self._spin.remove(link.spin)
            link.close()
            if link.held is not None:
                self._release(link.held)

    def _admit(self, link: _Link, hello: dict[str, Any]) -> bool:
        """A channel's HELLO: its ticket gives it its caller's scope, or it is turned away."""
        channels = self._channels
        ticket = str(hello.get("ticket", ""))
        redeemed = None if channels is None else channels.redeem(ticket, link.network)
        if channels is None or redeemed is None:
            link.send_state(False, "unknown or used channel ticket: call OpenChannel for one")
            link.linger()
            return False
        scope, link.held = redeemed
        max_in_flight = channels.max_in_flight
        if link.network:  # one request at a time: its transfers pair up in order
            network = self._network
            assert network is not None
            try:
                runtime = self._ready()
            except MoeLoraError as exc:  # stopped serving since the ticket was given
                link.send_state(False, exc.message)
                link.linger()
                return False
            link.send_state(self._serving, self._reason, admitted=True)  # now join the group
            link.data = network.data_link(ticket, runtime.placement.device)
            link.data.connect(peer_gone(link.connection.sock))
            max_in_flight = 1
        elif hello.get("spin") and self._spin is not None:
            link.spin = self._spin.add(link)  # polled once its client has it: after admit
            if link.spin is not None:  # else --max-spin-channels are open: its socket
                max_in_flight = 1
        link.admit(scope, int(hello.get("pid", 0)), max_in_flight)
        if hello.get("spin") and not link.network:  # answered with its block, or without
            self._count_channels()  # before its client can see it open
            link.send_state(self._serving, self._reason, admitted=True, spin=link.spin)
        return True

    def _ring(self) -> None:
        """A spin channel's BELL: wakes the launch loop, which then polls the blocks."""
        runtime, spin = self._runtime, self._spin
        if runtime is not None and spin is not None and spin.ring():
            with contextlib.suppress(MoeLoraError):  # stopping: the block is answered so
                runtime.scheduler.post(_nothing)

    def _spun(self, entry: SpinEntry[_Link], payload: bytes, received: float) -> None:
        """On the launch loop's thread: a request found in a channel's spin block."""
        link = entry.link
        if not link.enter():  # its client posted again before the answer came
            self._finish(link, _Borrowed(), self._overloaded(link, payload))
            return
        self._forward(link, payload, received)

    def _overloaded(self, link: _Link, payload: bytes) -> ForwardResult:
        why = "a spin channel's one" if link.spin is not None else "--max-channel-in-flight"
        return _failure(
            ForwardDescriptor.peek_id(payload),
            Overloaded(
                f"{link.max_in_flight} requests of this channel are in flight, the most one may "
                f"have ({why}); wait for answers or open another channel",
                retry_after_ms=1,
            ),
        )

    def close(self) -> None:
        """Stops accepting and closes every link (the front ends see the engine go)."""
        self._closed.set()
        if self._listener is not None:
            self._listener.close()
        if self._channels is not None:
            self._channels.close()
        if self._network is not None:
            self._network.close()
        with self._lock:
            links = list(self._links)
        for link in links:
            link.connection.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- work ----------------------------------------------------------------------------------

    def _ready(self) -> ExecutorRuntime:
        runtime = self._runtime
        if runtime is None or not self._serving:
            raise Unavailable(f"{self._reason}; retry shortly or on another replica")
        return runtime

    def _dispatch(self, link: _Link, payload: bytes, received: float) -> None:
        """Hands a Forward descriptor to the launch loop's thread (``_forward``)."""
        runtime = self._runtime
        try:
            if runtime is None:
                self._ready()  # raises: not loaded yet
                return
            runtime.scheduler.post(functools.partial(self._forward, link, payload, received))
        except MoeLoraError as exc:
            self._finish(link, _Borrowed(), _failure(ForwardDescriptor.peek_id(payload), exc))

    def _forward(self, link: _Link, payload: bytes, received: float) -> None:
        """On the launch loop's thread: checks and prepares one request and queues it for a
        launch when that needs no waiting; else a worker thread prepares it (``_wait_ready``).
        Its answer goes back from the launch loop (``_answered``)."""
        request_id = ForwardDescriptor.peek_id(payload)
        held = _Borrowed()
        try:
            descriptor = _decoded(payload)
            request_id = descriptor.request_id
            runtime = self._ready()
            with runtime.device.guard():
                request = self._request(link, descriptor, held, runtime)
                preparing = time.perf_counter()
                stage = runtime.metrics.stage
                stage["decode"].observe(descriptor.decode_seconds)
                stage["dispatch"].observe(preparing - received)
                if link.channel:  # the caller's own number: capped as an RPC's deadline is
                    slot_wait = min(descriptor.slot_wait, runtime.settings.slot_wait_seconds)
                    descriptor = dataclasses.replace(descriptor, slot_wait=slot_wait)
                prepared = runtime.engine.prepare_at_once(request, descriptor.slot_wait)
            if prepared is None:
                if not link.channel:  # its front end stops counting it as queued work
                    link.send(Kind.WAITING, _U64.pack(request_id))
                self._pool.submit(
                    self._wait_ready, runtime, link, descriptor, request, held, received
                )
                return
            stage["prepare"].observe(time.perf_counter() - preparing)
            self._submit(runtime, link, descriptor, prepared, held, received)
            return
        except Exception as exc:
            result = _error_result(request_id, exc)
        self._finish(link, held, result)

    def _wait_ready(
        self,
        runtime: ExecutorRuntime,
        link: _Link,
        descriptor: ForwardDescriptor,
        request: ForwardInput,
        held: _Borrowed,
        received: float,
    ) -> None:
        """On a worker thread: prepares a request whose adapters must be asked for, fetched
        or packed first, then queues it."""
        try:
            preparing = time.perf_counter()
            with runtime.device.guard():
                prepared = runtime.engine.prepare(request, descriptor.slot_wait)
            runtime.metrics.stage["prepare"].observe(time.perf_counter() - preparing)
            self._submit(runtime, link, descriptor, prepared, held, received)
            return
        except Exception as exc:
            result = _error_result(descriptor.request_id, exc)
        self._finish(link, held, result)

    def _submit(
        self,
        runtime: ExecutorRuntime,
        link: _Link,
        descriptor: ForwardDescriptor,
        prepared: Prepared,
        held: _Borrowed,
        received: float,
    ) -> None:
        """Queues ``prepared``; from here the regions and the link's count are the
        callback's to release (raises, releasing nothing, if it cannot wait)."""
        done = functools.partial(self._answered, runtime, link, descriptor, held, received)
        runtime.scheduler.submit(prepared, done, link.flush)

    def _request(
        self,
        link: _Link,
        descriptor: ForwardDescriptor,
        held: _Borrowed,
        runtime: ExecutorRuntime,
    ) -> ForwardInput:
        """The request's tensors, counted by where the input lies: viewed where they lie in
        the front end's arena, in CUDA memory or in page-locked shared memory that only the
        GPU touches; otherwise copied out of a client's shared memory, the output written
        back once computed (``held.writes``; see ``regions``). Regions it names join
        ``held``."""

        scope = link.scope if link.channel else descriptor.scope

        def region(ref: TensorRef) -> HeldRegion | None:
            if link.data is not None:  # the channel's own buffer (``DataLink.receive``)
                return link.data.region
            if not ref.segment:
                return None
            found = self.regions.acquire(scope, ref.segment)
            held.regions.append(found)
            return found

        hidden_region, output_region = region(descriptor.hidden), region(descriptor.output)
        on_device = [r is not None and r.on_device for r in (hidden_region, output_region)]
        if on_device[0] != on_device[1]:
            raise InvalidArgument(
                "shared_output: the input and the output must both be in CUDA memory or both "
                "in host memory",
                "shared_output",
            )
        hidden, output = descriptor.hidden, descriptor.output
        _check_shape(hidden, "shared_hidden_states")  # before ``maps`` trusts nbytes
        _check_shape(output, "shared_output")
        rows = hidden.shape[0] if hidden.shape else 1
        if not 1 <= descriptor.requests <= max(1, rows):
            raise InvalidArgument(
                f"requests: {descriptor.requests} client requests cannot share {rows} rows",
                "requests",
            )
        transport = "message" if hidden_region is None else hidden_region.info.transport
        runtime.metrics.forward_transports.labels(transport).inc(descriptor.requests)
        # A client's shared memory is viewed only where the request launches mapped, so that
        # no CPU code reads it (the compute dtype: else the rows would be staged).
        in_place = (
            hidden_region is not None
            and output_region is not None
            and not hidden_region.on_device
            and hidden_region.maps(hidden.offset, hidden.nbytes)
            and output_region.maps(output.offset, output.nbytes)
            and output.dtype == hidden.dtype
            and _torch_dtype(hidden, "shared_hidden_states") == runtime.placement.dtype
        )
        mapped = in_place or (
            hidden_region is None and output_region is None and link.mapped(hidden, output)
        )

        def tensor(
            ref: TensorRef, found: HeldRegion | None, field: str, role: str = "input"
        ) -> torch.Tensor:
            if role == "routing":  # the input's and the output's were checked above
                _check_shape(ref, field)
            if found is None:
                return link.tensor(ref, field)
            dtype = _torch_dtype(ref, field)
            count = math.prod(ref.shape)
            if found.on_device or (in_place and role != "routing"):  # the CPU checks routing
                return self.regions.view(found, ref.offset, count, dtype, field).view(ref.shape)
            if role != "output":
                return self.regions.read(found, ref.offset, ref.shape, dtype, field)
            self.regions.check(found, ref.offset, count, dtype, field)
            answer = torch.empty(ref.shape, dtype=dtype)
            held.writes.append((found, ref.offset, answer, field))
            return answer

        ids, weights = descriptor.topk_ids, descriptor.topk_weights
        routing_regions = [region(r) for r in (ids, weights) if r is not None]
        if any(r is not None and r.on_device for r in routing_regions):
            raise InvalidArgument(
                "routing: give routing as bytes or in shared memory, not in CUDA memory",
                "routing",
            )
        return ForwardInput(
            layer=descriptor.layer,
            hidden=tensor(descriptor.hidden, hidden_region, "shared_hidden_states"),
            segments=[
                _segment(link, i, n, adapter) for i, (n, adapter) in enumerate(descriptor.segments)
            ],
            topk_ids=(
                None
                if ids is None
                else tensor(ids, routing_regions[0], "routing.topk_ids", "routing")
            ),
            topk_weights=(
                None
                if weights is None
                else tensor(weights, routing_regions[1], "routing.topk_weights", "routing")
            ),
            output=tensor(descriptor.output, output_region, "shared_output", "output"),
            mapped=mapped,
            gpu_only=in_place,
            requests=descriptor.requests,
        )

    def _answered(
        self,
        runtime: ExecutorRuntime,
        link: _Link,
        descriptor: ForwardDescriptor,
        held: _Borrowed,
        received: float,
        answer: ForwardOutput | None,
        error: BaseException | None,
    ) -> None:
        """The launch loop's callback: the request's answer is in its output region (or,
        copied out of a client's shared memory, is written there now)."""
        request_id = descriptor.request_id
        if answer is not None:
            try:
                for region, offset, output, field in held.writes:
                    self.regions.write(region, offset, output, field)
            except (MoeLoraError, OSError) as exc:
                answer, error = None, exc
        if answer is not None:
            result = ForwardResult(
                request_id,
                _OK,
                resolved_adapters=tuple(answer.resolved_adapters),
                adapters_loaded=answer.adapters_loaded,
                loaded_adapters=answer.loaded_adapters,
                server_time_us=int(
                    (time.perf_counter() - received + descriptor.decode_seconds) * 1e6
                ),
            )
        else:
            assert error is not None  # the scheduler gives an answer or an error
            result = _error_result(request_id, runtime.device.translate(error))
        self._finish(link, held, result, later=True)

    def _finish(
        self, link: _Link, held: _Borrowed, result: ForwardResult, later: bool = False
    ) -> None:
        """Answers a request; ``later``: with the launch's other answers to its link, when
        the launch loop flushes them (``_Link.flush``)."""
        for region in held.regions:
            self.regions.release(region)
        if link.data is not None:
            try:
                link.data.send_output()
            except Exception as exc:  # an aborted group: the channel is over
                link.fail(exc)
        link.leave()
        if link.spin is not None and self._spin is not None:
            self._spin.reply(link.spin, result.request_id, _spin_answer(result))
        elif later:
            link.queue(Kind.RESULT, result.encode())
        else:
            link.send(Kind.RESULT, result.encode())

    def _call(self, link: _Link, payload: bytes) -> None:
        call = json.loads(payload)
        reply: dict[str, Any] = {"id": call["id"], "code": _OK, "message": "", "value": None}
        try:
            host_call = _HOST_CALLS.get(call["method"])
            if host_call is not None:
                reply["value"] = host_call(self, call["args"])
            else:
                runtime = self._ready()
                method = _CALLS.get(call["method"])
                if method is None:
                    raise InvalidArgument(f"unknown engine call {call['method']!r}")
                with runtime.device.guard():
                    reply["value"] = method(runtime, call["args"])
        except MoeLoraError as exc:
            failure = _failure(0, exc)
            reply.update(code=failure.code, message=failure.message)
            reply["retry_after_ms"] = failure.retry_after_ms
        except Exception:
            reply.update(
                code=grpc.StatusCode.INTERNAL.value[0],
                message=internal_error_message("engine_call_failed", method=call["method"]),
            )
        link.send(Kind.REPLY, json.dumps(reply).encode())


_U64 = struct.Struct("<Q")


def _nothing() -> None:
    """A posted task that only wakes the launch loop."""


def _spin_answer(result: ForwardResult) -> bytes:
    """``result`` encoded for a spin block, or an error saying why it does not fit."""
    encoded = result.encode()
    if len(encoded) <= ANSWER_BYTES:
        return encoded
    return _failure(
        result.request_id,
        InvalidArgument(
            f"segments: the answer's {len(result.resolved_adapters)} resolved adapters do not "
            "fit a spin channel's block; send fewer segments per request",
            "segments",
        ),
    ).encode()


class _Borrowed:
    """What a request holds of clients' regions until it is answered: the regions, and the
    answers to write into shared memory (region, offset, tensor, field) once computed."""

    __slots__ = ("regions", "writes")

    def __init__(self) -> None:
        self.regions: list[HeldRegion] = []
        self.writes: list[tuple[HeldRegion, int, torch.Tensor, str]] = []


def _decoded(payload: bytes) -> ForwardDescriptor:
    """The descriptor; INVALID_ARGUMENT if it is malformed (a channel's client wrote it)."""
    try:
        return ForwardDescriptor.decode(payload)
    except (struct.error, ValueError, UnicodeDecodeError) as exc:
        raise InvalidArgument(
            f"descriptor: malformed ({exc}); see the channel frames in docs/api.md",
            "descriptor",
        ) from None


def _segment(link: _Link, index: int, tokens: int, adapter: str) -> Segment:
    """A descriptor's segment; on a channel, ``#i`` names the i-th adapter it leased."""
    if not (link.channel and adapter.startswith("#")):
        return Segment(tokens, adapter)  # a reference, parsed with the request
    leased = link.held.adapters if link.held is not None else ()
    handle = adapter[1:]
    if not (
        0 < len(handle) <= 9 and handle.isascii() and handle.isdigit() and int(handle) < len(leased)
    ):
        field = f"segments[{index}].adapter"
        raise InvalidArgument(
            f"{field}: {adapter[:40]!r} names no adapter this channel leased "
            f"({len(leased)} leased: #0 to #{len(leased) - 1})"
            if leased
            else f"{field}: {adapter[:40]!r}: this channel leased no adapters (OpenChannel)",
            field,
        )
    return Segment(tokens, adapter, leased[int(handle)])


def _check_shape(ref: TensorRef, field: str) -> None:
    """A channel's client wrote the shape (a front end checked its own): dims that make a
    tensor of the bytes the reference says."""
    if len(ref.shape) > MAX_DIMS or any(d < 0 for d in ref.shape):
        raise InvalidArgument(f"{field}.shape: {list(ref.shape)} is not a shape", f"{field}.shape")
    count = math.prod(ref.shape)
    if count > MAX_ELEMENTS or count * _torch_dtype(ref, field).itemsize != ref.nbytes:
        raise InvalidArgument(
            f"{field}.shape: {list(ref.shape)} does not make {ref.nbytes} bytes", f"{field}.shape"
        )


def _torch_dtype(ref: TensorRef, field: str) -> torch.dtype:
    wire = WIRE_TYPES.get(ref.dtype)  # type: ignore[call-overload]
    if wire is None:
        raise InvalidArgument(f"{field}.dtype: unsupported dtype {ref.dtype}", f"{field}.dtype")
    dtype: torch.dtype = getattr(torch, wire.torch)
    return dtype


def _error_result(request_id: int, exc: BaseException) -> ForwardResult:
    """A Forward that failed: a domain error's status and message, anything else INTERNAL
    (logged under an error id)."""
    if isinstance(exc, MoeLoraError):
        return _failure(request_id, exc)
    message = internal_error_message("forward_internal_error", exc=exc, request_id=request_id)
    return ForwardResult(request_id, grpc.StatusCode.INTERNAL.value[0], message)


def _failure(request_id: int, exc: MoeLoraError) -> ForwardResult:
    retry = exc.retry_after_ms if isinstance(exc, Overloaded) else 0
    return ForwardResult(request_id, exc.code.value[0], exc.message, retry_after_ms=retry)


class _Link:
    """One front end, as the engine sees it."""

    def __init__(
        self,
        connection: Connection,
        send_timeout: float,
        channel: bool = False,
        network: bool = False,
    ) -> None:
        self.connection = connection
        #: A client's direct channel (else a front end): its scope comes from its ticket, its
        #: tensors only from registered regions, and it may not make admin calls.
        self.channel = channel
        #: A network channel: its tensors travel over ``data``, made at its HELLO.
        self.network = network
        self.data: DataLink | None = None
        #: A direct channel's spin block (its requests and answers go there, not the socket).
        self.spin: SpinEntry[_Link] | None = None
        self.scope = ""
        #: A channel's lease, released when the channel ends.
        self.held: HeldAdapters | None = None
        self.max_frame = CHANNEL_MAX_FRAME if channel else MAX_FRAME
        self._max_in_flight = 0  # 0: no limit (a front end bounds its own calls)
        if channel:  # a peer that connects and says nothing does not keep its thread
            connection.sock.setsockopt(
                socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(HELLO_TIMEOUT_SECONDS)
            )
        # SO_SNDTIMEO bounds sends alone; the reader's receives still block as they should.
        connection.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(send_timeout))
        self.pid = 0
        self._arena: ShmSegment | None = None
        #: The arena as bytes (requests' tensors are views of it), and how many of its first
        #: bytes are page-locked for the GPU (0: none).
        self._flat: torch.Tensor | None = None
        #: ``_flat`` viewed per dtype, made as requests ask for them.
        self._typed: dict[torch.dtype, torch.Tensor] = {}
        self._pinned = 0
        self._device: torch.device | None = None
        self._in_flight = 0
        self._idle = threading.Condition()
        self._open = True
        #: Answers kept for one write after the launch (``queue``, ``flush``).
        self._outbox: list[bytes] = []

    @property
    def max_in_flight(self) -> int:
        """A channel's limit on requests in flight (0: none, a front end)."""
        return self._max_in_flight

    @property
    def ready(self) -> bool:
        """May send Forward descriptors (a channel once its ticket was taken)."""
        return not self.channel or self._max_in_flight > 0

    def admit(self, scope: str, pid: int, max_in_flight: int) -> None:
        self.scope, self.pid, self._max_in_flight = scope, pid, max_in_flight
        self.connection.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(0))
        log_event(log, "channel_opened", pid=pid)

    def hello(self, message: dict[str, Any]) -> None:
        self.pid = int(message.get("pid", 0))
        self._arena = ShmSegment(str(message["arena"]))
        # Both ends have it mapped now: its name can go, so that no crash leaves it behind.
        self._arena.unlink()
        self._flat = torch.frombuffer(self._arena.buffer, dtype=torch.uint8)
        log_event(log, "front_end_connected", pid=self.pid, arena=self._arena.name)

    def pin(self, limit: int, device: torch.device) -> None:
        """Page-locks the arena's first ``limit`` bytes for ``device`` (once). A failure costs
        only speed: the requests are then copied through staging."""
        with self._idle:  # HELLO's reader and ``attach`` may both come
            flat = self._flat
            size = 0 if flat is None else min(limit, flat.numel())
            if flat is None or self._pinned or size == 0:
                return
            started = time.perf_counter()
            try:
                register_host(flat.data_ptr(), size, device)
            except CudaError as exc:
                log_event(log, "arena_pin_failed", logging.WARNING, pid=self.pid, error=str(exc))
                return
            self._pinned, self._device = size, device
        log_event(
            log,
            "arena_pinned",
            pid=self.pid,
            bytes=size,
            seconds=round(time.perf_counter() - started, 3),
        )

    def mapped(self, *refs: TensorRef) -> bool:
        """Whether the tensors lie wholly in the arena's page-locked bytes."""
        return all(r.offset >= 0 and r.offset + r.nbytes <= self._pinned for r in refs)

    def tensor(self, ref: TensorRef, field: str) -> torch.Tensor:
        """A view of ``ref`` (its shape checked: ``_check_shape``) in the front end's arena,
        bounds checked."""
        arena = self._arena
        if arena is None:
            raise InvalidArgument(
                f"{field}: a direct channel's tensors must be in regions its caller registered "
                "(RegisterCudaMemory, RegisterSharedMemory)",
                field,
            )
        dtype = _torch_dtype(ref, field)
        end = ref.offset + ref.nbytes
        if ref.offset < 0 or end > arena.size:
            raise InvalidArgument(f"{field}: {ref} lies outside its shared memory", field)
        if ref.offset % dtype.itemsize:
            raise InvalidArgument(f"{field}: {ref} is not aligned to its dtype", field)
        if ref.nbytes == 0:
            return torch.empty(ref.shape, dtype=dtype)
        # One torch call per tensor: each one may hand the GIL to the readers.
        typed = self._typed.get(dtype)
        if typed is None:
            assert self._flat is not None  # with the arena
            whole = self._flat.numel() // dtype.itemsize * dtype.itemsize
            typed = self._typed[dtype] = self._flat[:whole].view(dtype)
        return typed.as_strided(
            ref.shape, _contiguous_strides(ref.shape), ref.offset // dtype.itemsize
        )

    def send(self, kind: Kind, payload: bytes) -> None:
        if not self._open:
            return  # its front end went away: nobody waits for this answer
        try:
            self.connection.send(kind, payload)
        except OSError as exc:
            self._give_up(exc)

    def queue(self, kind: Kind, payload: bytes) -> None:
        """Keeps a frame for ``flush`` (the launch loop's alone: one write per launch)."""
        self._outbox.append(frame(kind, payload))

    def flush(self) -> None:
        """Sends the frames ``queue`` kept, in one write."""
        frames, self._outbox = self._outbox, []
        if not frames or not self._open:
            return
        try:
            self.connection.send_frames(frames)
        except OSError as exc:
            self._give_up(exc)

    def send_state(
        self,
        serving: bool,
        reason: str,
        admitted: bool = False,
        spin: SpinEntry[_Link] | None = None,
    ) -> None:
        """The engine's state; ``admitted``: a channel's ticket was taken (a network channel's
        client joins the channel's group next; ``spin``: the block goes with the frame)."""
        state: dict[str, Any] = {"serving": serving, "reason": reason}
        if admitted:
            state["admitted"] = True
        if spin is None:
            self.send(Kind.STATE, json.dumps(state).encode())
            return
        state["spin"] = True
        try:
            self.connection.send_fd(Kind.STATE, json.dumps(state).encode(), spin.block.fd)
        except OSError as exc:
            self._give_up(exc)
        finally:
            spin.block.sent()

    def fail(self, exc: BaseException) -> None:
        """Ends a network channel whose group failed (its reader sees the socket close)."""
        log_event(
            log, "network_channel_failed", logging.WARNING, pid=self.pid, error=str(exc)[:200]
        )
        self._open = False
        with contextlib.suppress(OSError):
            self.connection.sock.shutdown(socket.SHUT_RDWR)

    def _give_up(self, exc: OSError) -> None:
        """The front end is gone, or stopped reading: a frame may be half sent, so the
        connection ends (its reader sees it; the front end exits and is started again)."""
        if not self._open:
            return
        self._open = False
        if isinstance(exc, BlockingIOError | TimeoutError):
            log_event(log, "front_end_stalled", logging.ERROR, pid=self.pid)
        with contextlib.suppress(OSError):
            self.connection.sock.shutdown(socket.SHUT_RDWR)

    def linger(self) -> None:
        """Says no more and reads until the peer hangs up (at most the HELLO timeout): closing
        with its frames unread would reset the connection, losing what was sent it."""
        with contextlib.suppress(OSError):
            self.connection.sock.shutdown(socket.SHUT_WR)
            while self.connection.sock.recv(65536):
                pass

    def enter(self) -> bool:
        """Counts a request in (``leave`` counts it out); False past a channel's limit (it is
        counted anyway, and answered at once)."""
        with self._idle:
            self._in_flight += 1
            return not self._max_in_flight or self._in_flight <= self._max_in_flight

    def leave(self) -> None:
        with self._idle:
            self._in_flight -= 1
            self._idle.notify_all()

    def close(self) -> None:
        """Once the requests in flight are done with its arena, unmaps it."""
        self._open = False
        self.connection.close()

        def release() -> None:
            with self._idle:
                self._idle.wait_for(lambda: self._in_flight == 0)
            # Every launch that read or wrote it has been synchronised by now.
            if self._pinned and self._flat is not None and self._device is not None:
                self._pinned = 0
                try:
                    unregister_host(self._flat.data_ptr(), self._device)
                except CudaError:  # a lost device: the pages go with the process
                    log_event(log, "arena_unpin_failed", logging.WARNING, exc_info=True)
            self._flat = None
            self._typed = {}
            if self._arena is not None:
                self._arena.close()
            if self.data is not None:
                self.data.close()
            log_event(log, "channel_closed" if self.channel else "front_end_gone", pid=self.pid)

        threading.Thread(target=release, name="engine-link-release", daemon=True).start()


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def _timeval(seconds: float) -> bytes:
    whole, fraction = divmod(seconds, 1.0)
    return struct.pack("ll", int(whole), int(fraction * 1e6))


class _Channels:
    """The direct channels' listening socket and the tickets that let clients in."""

    #: A ticket not used within this long is void.
    TICKET_SECONDS = 60.0
    #: Tickets outstanding at once (OpenChannel called in a loop must not grow them unbounded).
    MAX_TICKETS = 4096

    def __init__(
        self,
        directory: Path | None,
        max_in_flight: int,
        max_per_token: int,
        release: Callable[[HeldAdapters | None], None],
    ) -> None:
        self._release = release
        self._max_per_token = max_per_token
        #: Per scope, OpenChannel calls between their place and their ticket.
        self._placing: collections.Counter[str] = collections.Counter()
        self._owned = directory is None
        self.directory = (
            Path(tempfile.mkdtemp(prefix="moelora-channels-")) if directory is None else directory
        )
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / f"engine-{os.getpid()}.sock"
        self.path.unlink(missing_ok=True)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(self.path))
        self.listener.listen(256)
        self.max_in_flight = max_in_flight
        self._lock = threading.Lock()
        #: ticket -> (scope, lease, expiry, network).
        self._tickets: dict[str, tuple[str, HeldAdapters | None, float, bool]] = {}

    @contextlib.contextmanager
    def place(self, scope: str, open_now: int) -> Iterator[None]:
        """Holds one of ``scope``'s places (it has ``open_now`` channels open) while its
        ticket is made; ResourceExhausted if its channels, unused tickets and tickets being
        made already take ``--max-channels-per-token`` ("": every caller with auth off, bound
        by the engine-wide limits alone)."""
        self._expire()
        with self._lock:
            mine = (
                open_now + self._placing[scope] + sum(v[0] == scope for v in self._tickets.values())
            )
            if scope and mine >= self._max_per_token:
                raise ResourceExhausted(
                    f"this token holds {mine} channels and unused channel tickets, the most "
                    "one token may (--max-channels-per-token); close channels or use the "
                    "tickets it has",
                    "channel",
                )
            self._placing[scope] += 1
        try:
            yield
        finally:
            with self._lock:
                self._placing[scope] -= 1
                self._placing = +self._placing  # drop the zeros

    def ticket(
        self, scope: str, held: HeldAdapters | None, network: bool = False
    ) -> dict[str, Any]:
        """A ticket for ``scope`` (``held``: its lease, released if none is given)."""
        ticket = secrets.token_urlsafe(24)
        self._expire()
        with self._lock:
            crowded = len(self._tickets) >= self.MAX_TICKETS
            if not crowded:
                expiry = time.monotonic() + self.TICKET_SECONDS
                self._tickets[ticket] = (scope, held, expiry, network)
        if crowded:
            self._release(held)
            raise Overloaded(
                f"{self.MAX_TICKETS} channel tickets are outstanding, the most the engine "
                "keeps; connect with the ones you have, or retry",
                retry_after_ms=1000,
            )
        if network:
            return {"socket": "", "ticket": ticket, "max_in_flight": 1}
        return {"socket": str(self.path), "ticket": ticket, "max_in_flight": self.max_in_flight}

    def redeem(self, ticket: str, network: bool) -> tuple[str, HeldAdapters | None] | None:
        """The ticket's scope and lease, once, if it is for this kind of channel (None:
        unknown, used, expired or for the other kind)."""
        self._expire()
        with self._lock:
            found = self._tickets.get(ticket)
            if found is None or found[3] != network:
                return None
            del self._tickets[ticket]
        return found[0], found[1]

    def _expire(self) -> None:
        """Voids tickets not used in time, ending their leases."""
        now = time.monotonic()
        with self._lock:
            gone = [t for t, v in self._tickets.items() if v[2] < now]
            expired = [self._tickets.pop(t)[1] for t in gone]
        for held in expired:
            self._release(held)

    def close(self) -> None:
        with self._lock:
            unused, self._tickets = list(self._tickets.values()), {}
        for _, held, _, _ in unused:
            self._release(held)
        self.listener.close()
        self.path.unlink(missing_ok=True)
        if self._owned:
            shutil.rmtree(self.directory, ignore_errors=True)


# -- admin calls: JSON in, JSON out ----------------------------------------------------------


def status_json(status: AdapterStatus) -> dict[str, Any]:
    return {
        "name": status.adapter.name,
        "version": status.adapter.version,
        "digest": status.adapter.digest,
        "location": status.location.value,
        "slot": status.slot,
        "pinned": status.pinned,
        "rank": status.rank,
        "nbytes": status.nbytes,
        "in_flight": status.in_flight,
        "last_used": status.last_used,
    }


def _ref(args: dict[str, Any]) -> AdapterRef:
    return AdapterRef.parse(str(args["adapter"]), "adapter")


def _load(runtime: ExecutorRuntime, args: dict[str, Any]) -> dict[str, Any]:
    return status_json(runtime.adapters.load(_ref(args), bool(args["to_gpu"]), args["wait"]))


def _unload(runtime: ExecutorRuntime, args: dict[str, Any]) -> dict[str, Any]:
    return status_json(runtime.adapters.unload(_ref(args), args["wait"]))


def _pin(runtime: ExecutorRuntime, args: dict[str, Any]) -> dict[str, Any]:
    return status_json(runtime.adapters.pin(_ref(args), args["wait"]))


def _unpin(runtime: ExecutorRuntime, args: dict[str, Any]) -> dict[str, Any]:
    return status_json(runtime.adapters.unpin(_ref(args)))


def _list(runtime: ExecutorRuntime, _args: dict[str, Any]) -> dict[str, Any]:
    stats = runtime.adapters.stats()
    return {
        "adapters": [status_json(s) for s in runtime.adapters.list_loaded()],
        "stats": dataclasses.asdict(stats),
    }


def _info(runtime: ExecutorRuntime, _args: dict[str, Any]) -> dict[str, Any]:
    settings, where = runtime.settings, runtime.placement
    return {
        "model_name": runtime.model.name,
        "spec": dataclasses.asdict(runtime.model.spec),
        "compute_dtype": str(where.dtype).removeprefix("torch."),
        "weight_format": runtime.model.weight_format,
        "num_slots": settings.num_slots,
        "max_rank": settings.max_rank,
        "device": where.device_name,
        "backend": where.backend_name,
        "slot_memory_bytes": runtime.adapters.stats().slot_memory_bytes,
        "host_cache_bytes": settings.host_cache_bytes,
        "max_tokens_per_request": settings.max_tokens_per_request,
        "max_message_bytes": settings.max_message_bytes,
        "server_version": package_version(),
        "served_layers": sorted(runtime.model.layers),
        "replica_name": replica_name(settings),
        "kernel_configs": [dataclasses.asdict(c) for c in runtime.kernel_configs],
        "registry": registry_status(runtime.adapters.source),
    }


def _region_json(info: RegionInfo) -> dict[str, Any]:
    return {
        "region": info.region,
        "kind": info.kind,
        "size": info.size,
        "shm_name": info.shm_name,
        "device_uuid": info.device_uuid,
    }


def _register(host: EngineHost, args: dict[str, Any]) -> dict[str, Any]:
    regions = host.regions
    info = regions.register(
        args["scope"], args["region"], args["shm_name"], int(args["size"]), host.region_pinning
    )
    return _region_json(info)


def _register_cuda(host: EngineHost, args: dict[str, Any]) -> dict[str, Any]:
    runtime = host._ready()  # the device to map the memory for
    with runtime.device.guard():
        info = host.regions.register_cuda(
            args["scope"],
            args["region"],
            bytes.fromhex(args["ipc_handle"]),
            int(args["size"]),
            str(args["device_uuid"]),
            runtime.placement.device,
        )
    return _region_json(info)


def _unregister(host: EngineHost, args: dict[str, Any]) -> None:
    host.regions.unregister(args["scope"], args["region"], args["kind"])


def _list_regions(host: EngineHost, args: dict[str, Any]) -> list[dict[str, Any]]:
    return [_region_json(r) for r in host.regions.list(args["scope"], args["kind"])]


def _open_channel(host: EngineHost, args: dict[str, Any]) -> dict[str, Any]:
    return host.open_channel(
        args["scope"],
        args.get("adapters", []),
        float(args.get("wait", 0)),
        bool(args.get("network", False)),
    )


#: Calls about clients' regions and channels, answered whether or not the model is loaded
#: (those that need the device ask for it themselves).
_HOST_CALLS: dict[str, Callable[[EngineHost, dict[str, Any]], Any]] = {
    "register_shm": _register,
    "register_cuda": _register_cuda,
    "unregister_region": _unregister,
    "list_regions": _list_regions,
    "open_channel": _open_channel,
}

_CALLS: dict[str, Callable[[ExecutorRuntime, dict[str, Any]], dict[str, Any]]] = {
    "load": _load,
    "unload": _unload,
    "pin": _pin,
    "unpin": _unpin,
    "list": _list,
    "info": _info,
}
