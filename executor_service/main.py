"""``moelora-executor``: runs the executor gRPC server."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from executor_service.app import ExecutorApp
from executor_service.config import ExecutorSettings
from executor_service.metrics import ExecutorMetrics
from shared.config import parse_settings
from shared.logs import configure_logging
from shared.metrics import start_metrics_server


def main(argv: Sequence[str] | None = None) -> None:
    settings = parse_settings(ExecutorSettings, argv)
    configure_logging(settings.log_level, settings.log_format)
    # The launching thread gives up the GIL in every torch call and must win it back from
    # handler threads decoding requests: a short switch interval bounds that wait.
    sys.setswitchinterval(settings.gil_switch_interval_us / 1e6)
    app = ExecutorApp(settings, ExecutorMetrics())
    start_metrics_server(settings.metrics_listen)
    app.serve_forever()
    if app.load_error is not None:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
