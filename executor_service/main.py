"""``moelora-executor``: runs the executor gRPC server."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from executor_service.app import FAULT_GRACE_SECONDS, ExecutorApp, log_load_failure
from executor_service.batch import KernelFn
from executor_service.config import ExecutorSettings
from executor_service.device_fault import DEVICE_FAULT_EXIT_CODE, DeviceFault
from executor_service.metrics import ExecutorMetrics
from executor_service.process import configure_process
from executor_service.runtime import ExecutorRuntime, build_runtime
from executor_service.serving.engine_host import EngineHost
from executor_service.serving.frontends import FrontEnds, frontend_count, metrics_registry
from moelora.client.logs import configure_logging, log_event
from moelora.client.shared_memory import SHM_ROOT
from shared.config import parse_settings
from shared.metrics import start_metrics_server
from shared.startup import (
    StartupError,
    check_listen,
    concrete_listen,
    exit_on_startup_error,
    setting_name,
)

log = logging.getLogger(__name__)

PROG = ExecutorSettings.prog_name
_CHECKPOINT = "point it at a Hugging Face checkpoint folder (config.json + *.safetensors)"

#: After a device fault, how long the drain may take before the process ends regardless (a
#: lost device can hang a clean-up call).
_FAULT_EXIT_DEADLINE_SECONDS = FAULT_GRACE_SECONDS + 10.0


def check_base_model(settings: ExecutorSettings) -> None:
    """Refuses, before anything starts, a base model path that is no readable checkpoint."""
    setting = setting_name(ExecutorSettings, "base_model_path")
    if settings.base_model_path is None:
        raise StartupError(
            "no base model to serve",
            setting,
            "set it to a Hugging Face checkpoint folder (config.json + *.safetensors)",
        )
    path = settings.base_model_path.expanduser()
    if not path.is_dir():
        raise StartupError(f"base model {path}: no such folder", setting, _CHECKPOINT)
    try:
        json.loads((path / "config.json").read_text())
    except OSError as exc:
        raise StartupError(
            f"base model {path}: cannot read config.json ({exc.strerror})", setting, _CHECKPOINT
        ) from None
    except ValueError as exc:
        raise StartupError(
            f"base model {path}: config.json is not JSON ({exc})", setting, _CHECKPOINT
        ) from None


def check_shared_memory(settings: ExecutorSettings, front_ends: int) -> None:
    """Refuses to start when /dev/shm cannot hold the front ends' arenas: a write past a
    full tmpfs kills the process with SIGBUS, not an error."""
    need = front_ends * settings.frontend_arena_bytes
    free = shutil.disk_usage(SHM_ROOT).free
    if need > free:
        raise StartupError(
            f"{SHM_ROOT} has {free / 2**20:.0f} MiB free; {front_ends} front end(s) need "
            f"{need / 2**20:.0f} MiB of shared memory",
            setting_name(ExecutorSettings, "frontend_arena_bytes"),
            "lower it or --frontends, or mount a larger /dev/shm (the chart's executor.shmSize)",
        )


def serve(settings: ExecutorSettings, kernel: KernelFn | None = None) -> None:
    """Runs the executor until it is drained; raises StartupError when it cannot start or
    its base model fails to load, and ends the process after a device fault."""
    check_listen(settings.listen, setting_name(ExecutorSettings, "listen"))
    check_listen(settings.metrics_listen, setting_name(ExecutorSettings, "metrics_listen"))
    check_base_model(settings)
    configure_process(settings)
    count = frontend_count(settings.frontends)
    check_shared_memory(settings, max(count, 1))
    if count == 0:
        _serve_in_process(settings, kernel)
    else:
        _serve_with_front_ends(settings, kernel, count)


def _serve_in_process(settings: ExecutorSettings, kernel: KernelFn | None) -> None:
    """``--frontends 0``: the engine and one gRPC front end in this process."""
    app = ExecutorApp(settings, ExecutorMetrics(), kernel)
    threading.Thread(target=_exit_after_fault, args=(app,), daemon=True).start()
    start_metrics_server(settings.metrics_listen)
    app.serve_forever()
    if app.device_fault is not None:
        _exit(DEVICE_FAULT_EXIT_CODE)
    if app.load_error is not None:
        raise _load_failed(settings, app.load_error)


def _serve_with_front_ends(settings: ExecutorSettings, kernel: KernelFn | None, count: int) -> None:
    """This process is the engine: it loads the model and serves ``count`` front-end
    processes, which serve gRPC on ``--listen`` (serving/frontends.py)."""
    workdir = Path(tempfile.mkdtemp(prefix="moelora-executor-"))
    metrics_dir = workdir / "metrics"
    metrics_dir.mkdir()
    host = EngineHost(
        workers=(settings.grpc_workers + 8) * count,
        pinned_bytes=settings.frontend_arena_pinned_bytes,
        region_pinned_bytes=settings.shared_memory_pinned_bytes,
        spin_seconds=settings.channel_spin_us / 1e6,
        max_spin_channels=settings.max_spin_channels,
    )
    host.listen(workdir / "engine.sock")
    host.listen_channels(
        settings.channel_dir, settings.max_channel_in_flight, settings.max_channels_per_token
    )
    host.listen_network_channels(
        settings.network_channel_port,
        settings.network_channel_host,
        settings.max_network_channels,
        settings.network_channel_buffer_bytes,
    )
    listen = concrete_listen(settings.listen)
    front_ends = FrontEnds(
        settings.model_copy(update={"listen": listen}), workdir / "engine.sock", count, metrics_dir
    )
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log_event(log, "signal_received", signal=signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    front_ends.start()
    start_metrics_server(settings.metrics_listen, metrics_registry(front_ends))
    log_event(log, "server_started", address=listen, front_ends=count, pids=front_ends.pids)
    loading = _Loading(settings, kernel)
    while not (stop.wait(0.2) or loading.done.is_set()):
        pass
    runtime = loading.runtime
    if runtime is None:
        front_ends.stop(1.0)
        host.close()
        shutil.rmtree(workdir, ignore_errors=True)
        log_event(log, "server_stopped")
        if loading.error is not None:
            raise _load_failed(settings, loading.error)
        return  # stopped while loading
    faulted = threading.Event()

    def on_fault(fault: DeviceFault) -> None:
        host.set_state(False, fault.describe())
        faulted.set()

    runtime.device.on_fault(on_fault)
    host.attach(runtime)
    host.set_state(True)
    while not (stop.wait(0.2) or faulted.is_set()):
        pass
    if faulted.is_set():
        # The front ends answer UNAVAILABLE naming the fault meanwhile, then go.
        time.sleep(FAULT_GRACE_SECONDS)
        front_ends.stop(1.0)
        _exit(DEVICE_FAULT_EXIT_CODE)
    host.set_state(False, "server is draining")
    front_ends.stop(settings.drain_seconds)
    host.close()
    runtime.close()
    shutil.rmtree(workdir, ignore_errors=True)
    log_event(log, "server_stopped")


class _Loading:
    """The base model loading in a background thread (SIGTERM is heard meanwhile)."""

    def __init__(self, settings: ExecutorSettings, kernel: KernelFn | None) -> None:
        self.done = threading.Event()
        self.runtime: ExecutorRuntime | None = None
        self.error: BaseException | None = None
        self._settings, self._kernel = settings, kernel
        threading.Thread(target=self._load, name="load-base-model", daemon=True).start()

    def _load(self) -> None:
        try:
            self.runtime = build_runtime(self._settings, ExecutorMetrics(), self._kernel)
        except BaseException as exc:
            self.error = exc
            log_load_failure(self._settings, exc)
        self.done.set()


def _load_failed(settings: ExecutorSettings, error: BaseException) -> StartupError:
    return StartupError(
        f"base model {settings.base_model_path} failed to load: {error}",
        setting_name(ExecutorSettings, "base_model_path"),
        _CHECKPOINT,
    )


def main(argv: Sequence[str] | None = None, kernel: KernelFn | None = None) -> None:
    """Runs the executor until it is drained. ``kernel`` replaces ``kernels.moe_forward``
    (the fault-injection tests' executor process passes one)."""
    settings = parse_settings(ExecutorSettings, argv)
    configure_logging(settings.log_level, settings.log_format)
    with exit_on_startup_error(PROG):
        serve(settings, kernel)


def _exit_after_fault(app: ExecutorApp) -> None:
    app.faulted.wait()
    if not app.server.wait(_FAULT_EXIT_DEADLINE_SECONDS):
        log_event(log, "device_fault_drain_hung", logging.ERROR)
        _exit(DEVICE_FAULT_EXIT_CODE)


def _exit(status: int) -> None:
    """Ends the process without the interpreter's clean-up, which may touch a lost device."""
    log_event(log, "executor_exiting", logging.ERROR, status=status, reason="device fault")
    logging.shutdown()
    os._exit(status)


if __name__ == "__main__":
    main()
