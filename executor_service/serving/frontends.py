"""Front-end processes: ``--frontends`` gRPC servers on the executor's one port.

One Python process decoding, validating and encoding every request under one GIL caps a GPU
executor at a few tens of thousands of tokens per second (docs/executor.md). So the process
that owns the GPU (the engine, ``engine_host.EngineHost``) runs no gRPC server; front-end
processes do, each on the same address with ``SO_REUSEPORT`` (the kernel spreads connections
over them), each with its own arena of shared memory, connected to the engine over a Unix
socket. A front end authorizes and checks a request, copies its tensors into its arena once,
and waits for the engine's answer; health reports what the engine says (loading, serving,
faulted).

The engine's process supervises them: a front end that dies is logged and started again (the
engine drops what it held for it), SIGTERM drains them all, and if the engine goes away each
front end stops answering and exits non-zero. Their gRPC metrics reach the engine's /metrics
through prometheus-client's multiprocess mode (``metrics_registry``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import multiprocessing.process
import os
import signal
import socket
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from prometheus_client import REGISTRY, CollectorRegistry, Metric
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

from executor_service.auth import open_authorizer
from executor_service.config import ExecutorSettings
from executor_service.server import ExecutorServicer
from executor_service.serving.arena import Arena
from executor_service.serving.engine_link import EngineLink
from moelora.client.logs import configure_logging, log_event
from moelora.v1 import executor_pb2, executor_pb2_grpc
from shared.grpc_server import GrpcServer

log = logging.getLogger(__name__)

SERVICE_NAME = executor_pb2.DESCRIPTOR.services_by_name["Executor"].full_name

#: A front end whose engine went away exits with this status.
ENGINE_GONE_EXIT_CODE = 4


def frontend_count(setting: int | None) -> int:
    """``--frontends``: None means one per two cores this process may run on, 1 to 8."""
    if setting is not None:
        return setting
    return max(1, min(8, len(os.sched_getaffinity(0)) // 2))


def max_streams(settings: ExecutorSettings) -> int:
    return settings.max_forward_streams or max(1, settings.grpc_workers * 3 // 4)


def run_front_end(settings: ExecutorSettings, engine_socket: str, index: int) -> None:
    """A front-end process: serves gRPC until SIGTERM (exit 0) or until the engine goes away
    (exit ``ENGINE_GONE_EXIT_CODE``)."""
    configure_logging(settings.log_level, settings.log_format)
    arena = Arena.create(f"moelora-frontend{index}", settings.frontend_arena_bytes)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(engine_socket)
    engine_gone = threading.Event()
    server: GrpcServer | None = None

    def on_state(serving: bool, _reason: str) -> None:
        if server is not None and not server.draining:
            server.set_serving(serving)

    def on_gone() -> None:
        engine_gone.set()
        if server is not None:
            threading.Thread(
                target=server.drain,
                kwargs={"grace": 1.0, "reason": "the executor's engine stopped"},
                daemon=True,
            ).start()

    link = EngineLink(sock, arena, on_state, on_gone)
    servicer = ExecutorServicer(link, settings, max_streams(settings))
    options = dataclasses.replace(settings.server_options(settings.grpc_workers), reuse_port=True)
    server = GrpcServer(
        options,
        [SERVICE_NAME],
        lambda grpc_server: executor_pb2_grpc.add_ExecutorServicer_to_server(servicer, grpc_server),
        authorizer=open_authorizer(settings),
    )
    link.start()
    log_event(log, "front_end_started", index=index, address=server.address)
    server.serve_forever(on_drained=link.close)
    arena.close()
    if engine_gone.is_set():
        log_event(
            log,
            "front_end_exiting",
            logging.ERROR,
            reason="engine gone",
            status=ENGINE_GONE_EXIT_CODE,
        )
        raise SystemExit(ENGINE_GONE_EXIT_CODE)


_METRICS_ENV = "PROMETHEUS_MULTIPROC_DIR"


class FrontEnds:
    """The front-end processes of one executor (see the module doc)."""

    def __init__(
        self, settings: ExecutorSettings, engine_socket: Path, count: int, metrics_dir: Path
    ) -> None:
        self._settings = settings
        self._socket = str(engine_socket)
        self._count = count
        self.metrics_dir = metrics_dir
        self._context = multiprocessing.get_context("spawn")
        self._processes: dict[int, multiprocessing.process.BaseProcess] = {}
        self._stopping = threading.Event()
        #: The process's own PROMETHEUS_MULTIPROC_DIR, given back at ``stop``.
        self._metrics_env: str | None = None

    def start(self) -> None:
        # Read by prometheus-client as a child imports it: their metrics go to files there.
        # Spawned children inherit this process's environment, so it is set here until
        # ``stop`` (a process that hosts front ends only for a while, as a benchmark does,
        # must not hand later children a folder that is gone).
        self._metrics_env = os.environ.get(_METRICS_ENV)
        os.environ[_METRICS_ENV] = str(self.metrics_dir)
        for index in range(self._count):
            self._spawn(index)
        threading.Thread(target=self._watch, name="front-end-watch", daemon=True).start()

    def _spawn(self, index: int) -> None:
        process = self._context.Process(
            target=run_front_end,
            args=(self._settings, self._socket, index),
            name=f"moelora-frontend-{index}",
            daemon=False,
        )
        process.start()
        self._processes[index] = process

    def _watch(self) -> None:
        """Starts again a front end that died while the executor runs."""
        while not self._stopping.wait(0.5):
            for index, process in list(self._processes.items()):
                if process.is_alive() or self._stopping.is_set():
                    continue
                assert process.pid is not None
                mark_process_dead(process.pid, str(self.metrics_dir))  # type: ignore[no-untyped-call]
                log_event(
                    log,
                    "front_end_exited",
                    logging.ERROR,
                    index=index,
                    pid=process.pid,
                    status=process.exitcode,
                    action="starting it again",
                )
                self._spawn(index)

    def stop(self, grace: float) -> None:
        """SIGTERM to every front end (each drains for up to ``grace``), then SIGKILL to any
        left."""
        self._stopping.set()
        for process in self._processes.values():
            if process.is_alive() and process.pid is not None:
                os.kill(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace + 5.0
        for process in self._processes.values():
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()
        if self._metrics_env is None:
            os.environ.pop(_METRICS_ENV, None)
        else:
            os.environ[_METRICS_ENV] = self._metrics_env

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._processes.values() if p.pid is not None and p.is_alive()]

    def resident_bytes(self) -> dict[int, int]:
        """Each live front end's resident memory (VmRSS), by index."""
        resident = {}
        for index, process in list(self._processes.items()):
            if process.pid is None or not process.is_alive():
                continue
            with contextlib.suppress(OSError, ValueError):
                for line in Path(f"/proc/{process.pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        resident[index] = int(line.split()[1]) * 1024
        return resident


class _Union:
    """The engine's own metrics and the front ends' (their files), each family once, and the
    front ends' memory (``process_resident_memory_bytes`` is the engine's alone)."""

    def __init__(self, front_ends: FrontEnds) -> None:
        self._front_ends = front_ends
        self._files = CollectorRegistry()
        MultiProcessCollector(self._files, path=str(front_ends.metrics_dir))  # type: ignore[no-untyped-call]

    def collect(self) -> Iterable[Metric]:
        seen = set()
        for family in self._files.collect():
            seen.add(family.name)
            yield family
        for family in REGISTRY.collect():
            if family.name not in seen:
                yield family
        resident = GaugeMetricFamily(
            "moelora_executor_frontend_resident_memory_bytes",
            "Resident memory of each gRPC front-end process (the engine's own is "
            "process_resident_memory_bytes)",
            labels=["front_end"],
        )
        for index, value in sorted(self._front_ends.resident_bytes().items()):
            resident.add_metric([str(index)], value)
        yield resident


def metrics_registry(front_ends: FrontEnds) -> CollectorRegistry:
    """What the engine's /metrics serves: its own series, its front ends' and their memory."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(_Union(front_ends))
    return registry
