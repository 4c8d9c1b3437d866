"""Prometheus and promtool from Debian's ``prometheus`` package, which ``make setup`` unpacks
into .tools/prometheus: a real Prometheus that scrapes the services, and its linter."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from shared.ports import free_port
from tests.conftest import REPO, ServerProcess

BIN = REPO / ".tools" / "prometheus" / "usr" / "bin"


def tool(name: str) -> Path:
    """The binary; a test without it fails (it is part of `make setup`), never skips."""
    path = BIN / name
    if not path.exists():
        pytest.fail(f"{path} is missing: run `make setup` (it unpacks Debian's prometheus package)")
    return path


def promtool(*args: str, stdin: bytes | None = None, cwd: Path | None = None) -> str:
    """Runs promtool; fails the test with its output unless it exits 0."""
    done = subprocess.run(
        [str(tool("promtool")), *args], input=stdin, capture_output=True, cwd=cwd, timeout=60
    )
    output = (done.stdout + done.stderr).decode(errors="replace")
    assert done.returncode == 0, f"promtool {' '.join(args)}:\n{output}"
    return output


class Prometheus:
    """A Prometheus process scraping ``targets`` (job -> (host:port, labels)) every second
    and evaluating ``rules`` every second; its HTTP API on a free port."""

    def __init__(self, root: Path, targets: dict[str, tuple[str, dict[str, str]]], rules: Path):
        root.mkdir(parents=True, exist_ok=True)
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(rules)],
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": [address], "labels": labels}]}
                for job, (address, labels) in targets.items()
            ],
        }
        (root / "prometheus.yml").write_text(yaml.safe_dump(config))
        promtool("check", "config", str(root / "prometheus.yml"))
        self.address = f"127.0.0.1:{free_port()}"
        self.process = ServerProcess(
            [
                str(tool("prometheus")),
                f"--config.file={root / 'prometheus.yml'}",
                f"--storage.tsdb.path={root / 'data'}",
                f"--web.listen-address={self.address}",
                "--log.level=warn",
            ],
            {},
            root / "prometheus.log",
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                self.query("up")
                return
            except OSError:
                assert self.process.proc.poll() is None, self.process.log()
                assert time.monotonic() < deadline, self.process.log()
                time.sleep(0.2)

    def api(self, path: str, **params: str) -> Any:
        url = f"http://{self.address}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as answer:
            body = json.loads(answer.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector ``expr`` evaluates to now (HTTP 400 for bad PromQL raises)."""
        data = self.api("query", query=expr)
        assert data["resultType"] == "vector", (expr, data)
        return list(data["result"])

    def scrapes(self, job: str) -> int:
        """Samples of ``up`` taken for ``job`` in the last minute."""
        found = self.query(f'count_over_time(up{{job="{job}"}}[1m])')
        return int(float(found[0]["value"][1])) if found else 0

    def stop(self) -> None:
        self.process.terminate()
