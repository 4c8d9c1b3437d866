"""``moelora-executor``: runs the executor gRPC server."""

from __future__ import annotations

from collections.abc import Sequence

from executor_service.app import ExecutorApp
from executor_service.config import ExecutorSettings
from executor_service.metrics import ExecutorMetrics
from executor_service.process import configure_process
from shared.config import parse_settings
from shared.logs import configure_logging
from shared.metrics import start_metrics_server


def main(argv: Sequence[str] | None = None) -> None:
    settings = parse_settings(ExecutorSettings, argv)
    configure_logging(settings.log_level, settings.log_format)
    configure_process(settings)
    app = ExecutorApp(settings, ExecutorMetrics())
    start_metrics_server(settings.metrics_listen)
    app.serve_forever()
    if app.load_error is not None:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
