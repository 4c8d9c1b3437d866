"""``moelora-executor``: runs the executor gRPC server."""

from __future__ import annotations

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

log = logging.getLogger(__name__)

#: After a device fault, how long the drain may take before the process ends regardless (a
#: lost device can hang a clean-up call).
_FAULT_EXIT_DEADLINE_SECONDS = FAULT_GRACE_SECONDS + 10.0


def main(argv: Sequence[str] | None = None, kernel: KernelFn | None = None) -> None:
    """Runs the executor until it is drained. ``kernel`` replaces ``kernels.moe_forward``
    (the fault-injection tests' executor process passes one)."""
    settings = parse_settings(ExecutorSettings, argv)
    configure_logging(settings.log_level, settings.log_format)
    configure_process(settings)
    app = ExecutorApp(settings, ExecutorMetrics(), kernel)
    threading.Thread(target=_exit_after_fault, args=(app,), daemon=True).start()
    start_metrics_server(settings.metrics_listen)
    app.serve_forever()
    if app.device_fault is not None:
        _exit(DEVICE_FAULT_EXIT_CODE)
    if app.load_error is not None:
        raise SystemExit(1)


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
