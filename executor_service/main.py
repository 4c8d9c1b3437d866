"""``moelora-executor``: runs the executor gRPC server."""

from __future__ import annotations

import json
from collections.abc import Sequence

from executor_service.app import ExecutorApp
from executor_service.config import ExecutorSettings
from executor_service.metrics import ExecutorMetrics
from executor_service.process import configure_process
from shared.config import parse_settings
from shared.logs import configure_logging
from shared.metrics import start_metrics_server
from shared.startup import StartupError, check_listen, exit_on_startup_error, setting_name

PROG = ExecutorSettings.prog_name
_CHECKPOINT = "point it at a Hugging Face checkpoint folder (config.json + *.safetensors)"


def check_base_model(settings: ExecutorSettings) -> None:
    """Refuses, before anything starts, a base model path that is no readable checkpoint."""
    path = settings.base_model_path.expanduser()
    setting = setting_name(ExecutorSettings, "base_model_path")
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


def serve(settings: ExecutorSettings) -> None:
    check_listen(settings.listen, setting_name(ExecutorSettings, "listen"))
    check_listen(settings.metrics_listen, setting_name(ExecutorSettings, "metrics_listen"))
    check_base_model(settings)
    configure_process(settings)
    app = ExecutorApp(settings, ExecutorMetrics())
    start_metrics_server(settings.metrics_listen)
    app.serve_forever()
    if app.load_error is not None:
        raise StartupError(
            f"base model {settings.base_model_path} failed to load: {app.load_error}",
            setting_name(ExecutorSettings, "base_model_path"),
            _CHECKPOINT,
        )


def main(argv: Sequence[str] | None = None) -> None:
    settings = parse_settings(ExecutorSettings, argv)
    configure_logging(settings.log_level, settings.log_format)
    with exit_on_startup_error(PROG):
        serve(settings)


if __name__ == "__main__":
    main()
