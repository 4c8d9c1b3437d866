"""``moelora-executor``: runs the executor gRPC server."""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Sequence

from executor_service.app import FAULT_GRACE_SECONDS, ExecutorApp
from executor_service.batch import KernelFn
from executor_service.config import ExecutorSettings
from executor_service.device_fault import DEVICE_FAULT_EXIT_CODE
from executor_service.metrics import ExecutorMetrics
from executor_service.process import configure_process
from shared.config import parse_settings
from shared.logs import configure_logging, log_event
from shared.metrics import start_metrics_server
from shared.startup import StartupError, check_listen, exit_on_startup_error, setting_name

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


def serve(settings: ExecutorSettings, kernel: KernelFn | None = None) -> None:
    """Runs the executor until it is drained; raises StartupError when it cannot start or
    its base model fails to load, and ends the process after a device fault."""
    check_listen(settings.listen, setting_name(ExecutorSettings, "listen"))
    check_listen(settings.metrics_listen, setting_name(ExecutorSettings, "metrics_listen"))
    check_base_model(settings)
    configure_process(settings)
    app = ExecutorApp(settings, ExecutorMetrics(), kernel)
    threading.Thread(target=_exit_after_fault, args=(app,), daemon=True).start()
    start_metrics_server(settings.metrics_listen)
    app.serve_forever()
    if app.device_fault is not None:
        _exit(DEVICE_FAULT_EXIT_CODE)
    if app.load_error is not None:
        raise StartupError(
            f"base model {settings.base_model_path} failed to load: {app.load_error}",
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
