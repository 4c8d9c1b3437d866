"""Structured logs: one JSON object per line, one line per event.

Call sites name the event and pass fields::

    log = logging.getLogger(__name__)
    log_event(log, "adapter_loaded", adapter="sql:3", slot=2, seconds=0.0041)

Libraries that log plain messages (grpc, sqlalchemy, alembic) come out as the same lines,
at the same level, with their message under the same key (``event``). Durations are
``seconds`` everywhere; timestamps are UTC in both formats.
"""

from __future__ import annotations

import json
import logging
import sys
import time
import uuid
from typing import Any

_FIELDS_ATTR = "moelora_fields"
_INTERNAL = logging.getLogger(__name__)


def _timestamp(record: logging.LogRecord) -> str:
    return (
        time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        + f".{int(record.msecs):03d}Z"
    )


def _event_and_fields(record: logging.LogRecord) -> tuple[str, dict[str, Any]]:
    """An event of ours with its fields, or a library's message as the event."""
    fields = getattr(record, _FIELDS_ATTR, None)
    if fields is None:
        return record.getMessage(), {}
    return str(record.msg), fields


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON line: ts, level, logger, event, fields."""

    def format(self, record: logging.LogRecord) -> str:
        event, fields = _event_and_fields(record)
        line: dict[str, Any] = {
            "ts": _timestamp(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": event,
            **fields,
        }
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """``ts level logger: event key=value ...`` for people at a terminal."""

    def format(self, record: logging.LogRecord) -> str:
        event, fields = _event_and_fields(record)
        text = f"{_timestamp(record)} {record.levelname.lower():7s} {record.name}: {event}"
        text += "".join(f" {k}={v}" for k, v in fields.items())
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


def configure_logging(level: str = "info", fmt: str = "json") -> None:
    """Routes every logger to stderr in the chosen format ("json" or "text")."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def log_event(
    logger: logging.Logger,
    event: str,
    level: int = logging.INFO,
    exc_info: bool | BaseException = False,
    **fields: Any,
) -> None:
    """Logs one event with structured fields (and the current exception, or the one given,
    if asked)."""
    if logger.isEnabledFor(level):
        logger.log(level, event, exc_info=exc_info, extra={_FIELDS_ATTR: fields})


def internal_error_message(
    event: str, *, exc: BaseException | None = None, **fields: object
) -> str:
    """Logs ``exc`` (default: the exception being handled) under a fresh error id with its
    traceback, and returns the message a caller gets: the id, never the internals."""
    error_id = uuid.uuid4().hex[:12]
    exc_info: BaseException | bool = exc if exc is not None else True
    log_event(_INTERNAL, event, logging.ERROR, exc_info=exc_info, error_id=error_id, **fields)
    return f"internal error (id {error_id}); see the server log"
