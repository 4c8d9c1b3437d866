"""How adapterctl prints: ``-o table|wide|name|json|yaml`` on stdout, errors on stderr.

In the conventions of kubectl and gh: tables are aligned columns that are never cut or
wrapped (a pipe gets every value whole, ``-`` for an empty one, so ``awk`` counts columns
right), ``wide`` adds columns, ``name`` prints one reference per line; JSON and YAML carry
every field of the API's messages, zero values included, numbers as numbers and enum values
in the words the table uses (``READY``, not ``ADAPTER_STATUS_READY``). With ``-o json`` or
``yaml`` an error is a JSON object on stderr as well.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, TextIO

import yaml
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

FORMATS = ("table", "wide", "name", "json", "yaml")
#: Smaller transfers take a blink: no bar.
_PROGRESS_MIN_BYTES = 4 * 1000**2


def _enum_prefix(enum_name: str) -> str:
    """``AdapterStatus`` -> ``ADAPTER_STATUS_``: the prefix every value of the enum carries."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", enum_name).upper() + "_"


def enum_word(field: FieldDescriptor, number: int) -> str:
    """An enum value as the table shows it: ``READY`` for ``ADAPTER_STATUS_READY``."""
    assert field.enum_type is not None
    value = field.enum_type.values_by_number.get(number)
    if value is None:
        return str(number)
    return value.name.removeprefix(_enum_prefix(field.enum_type.name))


def message_dict(message: Message) -> dict[str, Any]:
    """Every field of ``message``, zero values included: numbers as numbers (int64 too),
    enums as their short word, timestamps as RFC 3339 text (null when unset)."""
    fields: Sequence[FieldDescriptor] = message.DESCRIPTOR.fields  # type: ignore[assignment]
    return {field.name: _field_value(message, field) for field in fields}


def _field_value(message: Message, field: FieldDescriptor) -> Any:
    value = getattr(message, field.name)
    entry = field.message_type
    if entry is not None and entry.GetOptions().map_entry:
        value_field = entry.fields_by_name["value"]
        return {k: _scalar(value_field, v) for k, v in sorted(value.items())}
    if field.is_repeated:
        return [_scalar(field, item) for item in value]
    if entry is not None and not message.HasField(field.name):
        return None
    return _scalar(field, value)


def _scalar(field: FieldDescriptor, value: Any) -> Any:
    if field.type == FieldDescriptor.TYPE_ENUM:
        return enum_word(field, value)
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        if value.DESCRIPTOR.full_name == "google.protobuf.Timestamp":
            return value.ToJsonString()
        return message_dict(value)
    return value


def size_text(n: int) -> str:
    """Bytes for people, without a space (one column for awk): ``573B``, ``1.2MiB``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f}{unit}" if unit == "B" else f"{value:.1f}{unit}"
        value /= 1024
    raise AssertionError("unreachable")


def render_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns padded to their widest value, three spaces apart; nothing cut."""
    cells = [list(headers), *[[value or "-" for value in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["   ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(line.rstrip() for line in lines)


class Output:
    """Results on stdout in the chosen format; progress, notes and errors on stderr."""

    def __init__(self, format: str, stdout: TextIO | None = None) -> None:
        self.format = format
        self.stdout = stdout or sys.stdout
        self.err = Console(stderr=True, highlight=False)

    @property
    def structured(self) -> bool:
        return self.format in ("json", "yaml")

    @property
    def terminal(self) -> bool:
        return self.stdout.isatty()

    def data(self, value: Any) -> None:
        """``value`` (dicts, lists, scalars) as JSON or YAML."""
        if self.format == "yaml":
            text = yaml.safe_dump(value, sort_keys=True, allow_unicode=True)
        else:
            text = json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
        self.stdout.write(text)

    def line(self, text: str) -> None:
        self.stdout.write(text + "\n")

    def emit(
        self,
        value: Any,
        human: Callable[[bool], str],
        names: Sequence[str] | None = None,
    ) -> None:
        """``value`` for json/yaml, ``names`` one per line for ``-o name`` (the human text
        when there are none), else ``human(wide)``."""
        if self.structured:
            self.data(value)
        elif self.format == "name" and names is not None:
            for name in names:
                self.line(name)
        else:
            self.line(human(self.format == "wide"))

    def note(self, text: str) -> None:
        """A remark for people (stderr), never for scripts parsing stdout."""
        print(text, file=sys.stderr)

    def error(self, prog: str, code: str, message: str, exit_code: int) -> None:
        if self.structured:
            error = {"error": {"code": code, "message": message, "exit_code": exit_code}}
            print(json.dumps(error, sort_keys=True), file=sys.stderr)
        else:
            print(f"{prog}: {code}: {message}", file=sys.stderr)

    @contextmanager
    def progress(self, label: str, total: int) -> Iterator[Callable[[int], None]]:
        """A bar with bytes/s on stderr when it is a terminal and the transfer is over a few
        MB; silent otherwise."""
        bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            console=self.err,
            transient=True,
            disable=self.structured or not self.err.is_terminal or total < _PROGRESS_MIN_BYTES,
        )
        with bar:
            task = bar.add_task(label, total=total)
            yield lambda n: bar.advance(task, n)


def fields_text(fields: Mapping[str, Any], width: int = 24) -> str:
    """``key: value`` lines for ``show``: lists joined with commas, maps as k=v."""
    lines = []
    for key, value in fields.items():
        if isinstance(value, list):
            text = ", ".join(map(str, value))
        elif isinstance(value, dict):
            text = ", ".join(f"{k}={v}" for k, v in value.items())
        else:
            text = "" if value is None else str(value)
        lines.append(f"{key + ':':{width}} {text}".rstrip())
    return "\n".join(lines)
