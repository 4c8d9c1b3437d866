"""A service that cannot start says why in one line (what failed, the setting, the fix)
and exits non-zero, before it takes traffic: each case runs the console script."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.registry.fixtures import write_base_model

#: How long a script may take to give up (an executor imports torch first).
EXIT_SECONDS = 60


@pytest.fixture
def taken() -> Iterator[str]:
    """host:port of a socket that listens, so that nothing else can bind it."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield f"127.0.0.1:{holder.getsockname()[1]}"


def _exits(server: Any, code: int) -> str:
    """The one line the process printed besides its JSON log lines, once it exited ``code``."""
    assert server.proc.wait(EXIT_SECONDS) == code, server.log()
    log = server.log()
    assert "Traceback" not in log, log
    plain = [line for line in log.splitlines() if line.strip() and not line.startswith("{")]
    assert len(plain) == 1, log
    return str(plain[0])


def _executor(start_server: Any, port: int, model: Path) -> Any:
    """An executor on 127.0.0.1:``port`` over the checkpoint folder ``model``, metrics off."""
    return start_server(
        "moelora-executor", "--listen", f"127.0.0.1:{port}", "--metrics-listen", "",
        "--base-model-path", str(model),
    )  # fmt: skip


def _events(server: Any) -> list[dict[str, Any]]:
    return [json.loads(line) for line in server.log().splitlines() if line.startswith("{")]


@pytest.mark.parametrize("script", ["moelora-registry", "moelora-executor"])
def test_a_port_in_use_is_one_line_naming_the_address_and_the_setting(
    start_server: Any, taken: str, tmp_path: Path, script: str
) -> None:
    base = str(write_base_model(tmp_path / "base"))
    extra = ["--data-dir", str(tmp_path / "r")] if "registry" in script else []
    extra += ["--base-model-path", base] if "executor" in script else []
    server = start_server(script, "--listen", taken, "--metrics-listen", "", *extra)
    line = _exits(server, 1)
    assert line.startswith(f"{script}") and f"cannot listen on {taken}" in line
    assert "already in use (--listen / " in line and "choose another port" in line


@pytest.mark.parametrize("script", ["moelora-registry", "moelora-executor"])
def test_an_address_that_is_no_host_port_exits_2(
    start_server: Any, tmp_path: Path, script: str
) -> None:
    """Invalid in itself, like a value pydantic refuses: status 2, as docs/operations.md says."""
    base = str(write_base_model(tmp_path / "base"))
    extra = ["--data-dir", str(tmp_path / "r")] if "registry" in script else []
    extra += ["--base-model-path", base] if "executor" in script else []
    server = start_server(script, "--listen", "nonsense", "--metrics-listen", "", *extra)
    line = _exits(server, 2)
    assert line.startswith(script) and "'nonsense' is not host:port (--listen / " in line


def test_the_metrics_port_is_checked_before_the_model_loads(
    start_server: Any, taken: str, tmp_path: Path, port: int
) -> None:
    base = str(write_base_model(tmp_path / "base"))
    server = start_server(
        "moelora-executor", "--listen", f"127.0.0.1:{port}", "--metrics-listen", taken,
        "--base-model-path", base,
    )  # fmt: skip
    line = _exits(server, 1)
    assert f"cannot listen on {taken}" in line and "(--metrics-listen / " in line
    assert "server_started" not in [e["event"] for e in _events(server)]


def test_an_executor_needs_a_base_model(start_server: Any) -> None:
    line = _exits(start_server("moelora-executor"), 1)
    assert line.startswith("moelora-executor: no base model to serve (--base-model-path / ")
    assert "set it to a Hugging Face checkpoint folder" in line


@pytest.mark.parametrize(
    ("content", "why"),
    [(None, "no such folder"), ("{not json", "config.json is not JSON"), ("", "cannot read")],
)
def test_a_base_model_that_is_no_checkpoint_is_refused_at_once(
    start_server: Any, tmp_path: Path, port: int, content: str | None, why: str
) -> None:
    model = tmp_path / "model"
    if content is not None:
        model.mkdir()
        if content:
            (model / "config.json").write_text(content)
    server = _executor(start_server, port, model)
    line = _exits(server, 1)
    assert line.startswith(f"moelora-executor: base model {model}: {why}")
    assert "(--base-model-path / " in line and "checkpoint folder" in line


def test_a_checkpoint_that_fails_to_load_stops_the_server_after_it_started(
    start_server: Any, tmp_path: Path, port: int
) -> None:
    model = write_base_model(tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    del config["num_hidden_layers"]
    (model / "config.json").write_text(json.dumps(config))
    server = _executor(start_server, port, model)
    line = _exits(server, 1)
    assert line.startswith(f"moelora-executor: base model {model} failed to load: ")
    assert "num_hidden_layers" in line
    events = [e["event"] for e in _events(server)]
    failed = events.index("base_model_load_failed")
    assert events.index("server_started") < failed < events.index("server_stopped")


def test_auth_without_a_token_file_is_one_line(
    start_server: Any, tmp_path: Path, port: int
) -> None:
    server = start_server(
        "moelora-registry", "--listen", f"127.0.0.1:{port}", "--metrics-listen", "",
        "--data-dir", str(tmp_path / "r"), "--auth", "on",
    )  # fmt: skip
    line = _exits(server, 1)
    assert line.startswith("moelora-registry serve: auth=on needs --auth-tokens-file")


def test_an_unreachable_database_is_one_line_naming_the_setting(
    start_server: Any, tmp_path: Path, port: int
) -> None:
    with socket.socket() as closed:  # a port nothing listens on
        closed.bind(("127.0.0.1", 0))
        url = f"postgresql+psycopg://moelora@127.0.0.1:{closed.getsockname()[1]}/registry"
    server = start_server(
        "moelora-registry", "--listen", f"127.0.0.1:{port}", "--metrics-listen", "",
        "--data-dir", str(tmp_path / "r"), "--database-url", url, "--auth", "off",
    )  # fmt: skip
    line = _exits(server, 1)
    assert line.startswith("moelora-registry serve: cannot use the database: ")
    assert "(--database-url / " in line and "accepts connections" in line
