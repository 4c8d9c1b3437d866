"""The executor process: the gRPC server up at once, the base model loaded in the background.

The serving path is split in two (``serving/``): the engine (``EngineHost`` over the loaded
``ExecutorRuntime``), which owns the device, and a gRPC front end (``ExecutorServicer``), which
decodes requests into shared memory and hands the engine descriptors over a local socket. Here
both run in this process; ``main`` can add front-end processes on the same port.

Health says NOT_SERVING (and RPCs answer UNAVAILABLE) while the model loads, so that probes get
answers during a long load; SERVING once it is ready. A model that fails to load stops the
server, and ``main`` exits non-zero with the reason.
A device fault (``device_fault.py``) turns health NOT_SERVING at once and drains the server
within ``FAULT_GRACE_SECONDS``, new calls answered UNAVAILABLE naming the fault; ``main`` then
exits with ``DEVICE_FAULT_EXIT_CODE``.
"""

from __future__ import annotations

import logging
import socket
import threading

from executor_service.auth import open_authorizer
from executor_service.batch import KernelFn
from executor_service.config import ExecutorSettings
from executor_service.device_fault import DeviceFault
from executor_service.metrics import ExecutorMetrics
from executor_service.runtime import ExecutorRuntime, build_runtime
from executor_service.server import ExecutorServicer
from executor_service.serving.arena import Arena
from executor_service.serving.engine_host import EngineHost
from executor_service.serving.engine_link import EngineLink
from executor_service.sources import AdapterSource
from moelora.client.errors import MoeLoraError
from moelora.client.logs import log_event
from moelora.v1 import executor_pb2, executor_pb2_grpc
from shared.grpc_server import GrpcServer

log = logging.getLogger(__name__)

#: What a bad checkpoint or setting raises while the model loads (no traceback logged).
EXPECTED_LOAD_ERRORS = (ValueError, OSError, MoeLoraError)

SERVICE_NAME = executor_pb2.DESCRIPTOR.services_by_name["Executor"].full_name


def log_load_failure(settings: ExecutorSettings, exc: BaseException) -> None:
    log_event(
        log,
        "base_model_load_failed",
        logging.ERROR,
        # A checkpoint that is not what it should be says so; anything else is a bug.
        exc_info=not isinstance(exc, EXPECTED_LOAD_ERRORS),
        path=str(settings.base_model_path),
        error=str(exc),
    )


#: After a device fault, how long the server keeps answering (UNAVAILABLE, naming the fault)
#: before it stops: requests in flight fail fast, and new ones learn why rather than meet a
#: closed port.
FAULT_GRACE_SECONDS = 2.0


class ExecutorApp:
    """One executor: its server, servicer and loading thread. ``kernel`` and ``source``
    replace the defaults (see ``build_runtime``)."""

    def __init__(
        self,
        settings: ExecutorSettings,
        metrics: ExecutorMetrics,
        kernel: KernelFn | None = None,
        source: AdapterSource | None = None,
    ) -> None:
        self.settings = settings
        self._metrics = metrics
        self._kernel = kernel
        self._source = source
        # Refuses bad auth settings before anything is made that would need undoing (the
        # arena below is a named shared-memory object).
        authorizer = open_authorizer(settings)
        #: The engine: where requests meet the runtime once it is loaded.
        self.host = EngineHost(
            workers=settings.grpc_workers + 8,
            pinned_bytes=settings.frontend_arena_pinned_bytes,
            region_pinned_bytes=settings.shared_memory_pinned_bytes,
            spin_seconds=settings.channel_spin_us / 1e6,
            max_spin_channels=settings.max_spin_channels,
        )
        engine_end, front_end = socket.socketpair()
        self._arena = Arena.create("moelora-frontend", settings.frontend_arena_bytes)
        self.link = EngineLink(front_end, self._arena, on_state=self._on_engine_state)
        self.servicer = ExecutorServicer(
            self.link,
            settings,
            settings.max_forward_streams or max(1, settings.grpc_workers * 3 // 4),
        )
        self.server = GrpcServer(
            settings.server_options(settings.grpc_workers),
            [SERVICE_NAME],
            lambda server: executor_pb2_grpc.add_ExecutorServicer_to_server(self.servicer, server),
            authorizer=authorizer,
        )
        #: The loaded runtime, once ``loaded`` is set without ``load_error``.
        self.runtime: ExecutorRuntime | None = None
        #: Set once loading ended, successfully or not.
        self.loaded = threading.Event()
        self.load_error: BaseException | None = None
        #: Set once the device faulted (``device_fault`` says how).
        self.faulted = threading.Event()
        self.device_fault: DeviceFault | None = None
        self.host.serve(engine_end)
        self.host.listen_channels(
            settings.channel_dir, settings.max_channel_in_flight, settings.max_channels_per_token
        )
        self.host.listen_network_channels(
            settings.network_channel_port,
            settings.network_channel_host,
            settings.max_network_channels,
            settings.network_channel_buffer_bytes,
        )
        self.link.start()

    @property
    def address(self) -> str:
        return self.server.address

    def start(self) -> None:
        """Starts serving and loading; returns at once (tests and embedding)."""
        self.server.start()
        self._start_loading()

    def serve_forever(self) -> None:
        """Starts, drains on SIGTERM or SIGINT, returns once stopped (the process)."""
        self.server.serve_forever(on_drained=self._close, on_started=self._start_loading)

    def drain(self) -> None:
        self.server.drain(on_drained=self._close)

    def _close(self) -> None:
        self.host.set_state(False, "the executor is stopping")
        self.link.close()
        self.host.close()
        self._arena.close()
        if self.runtime is None:
            return
        try:
            self.runtime.close()
        except Exception:
            if self.device_fault is None:
                raise
            # A lost device may fail its own clean-up; the process ends regardless.
            log_event(log, "close_after_device_fault_failed", logging.WARNING, exc_info=True)

    def _on_engine_state(self, serving: bool, _reason: str) -> None:
        if not self.server.draining:
            self.server.set_serving(serving)

    def _on_device_fault(self, fault: DeviceFault) -> None:
        self.device_fault = fault
        self.host.set_state(False, fault.describe())
        self.server.set_serving(False)
        self.faulted.set()
        threading.Thread(
            target=self.server.drain,
            kwargs={
                "on_drained": self._close,
                "grace": FAULT_GRACE_SECONDS,
                "linger": FAULT_GRACE_SECONDS,
                "reason": fault.describe(),
            },
            name="drain-after-device-fault",
            daemon=True,
        ).start()

    def _start_loading(self) -> None:
        threading.Thread(target=self._load, name="load-base-model", daemon=True).start()

    def _load(self) -> None:
        try:
            runtime = build_runtime(self.settings, self._metrics, self._kernel, self._source)
        except BaseException as exc:
            self.load_error = exc
            log_load_failure(self.settings, exc)
            self.loaded.set()
            self.server.drain(on_drained=self._close)
            return
        self.runtime = runtime
        runtime.device.on_fault(self._on_device_fault)
        self.host.attach(runtime)
        self.host.set_state(True)
        if not self.server.draining:
            self.server.set_serving(True)
        self.loaded.set()
