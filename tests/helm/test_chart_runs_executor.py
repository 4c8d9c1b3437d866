"""The executor runs from exactly the configuration the chart renders: the model-fetch
init container fills the model volume from S3 (moto), the executor starts from its
StatefulSet's environment, pulls an adapter from the registry (uploaded as NOTES.txt
says), and answers the Forward call NOTES.txt shows."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.conftest import REPO
from tests.helm.chart import (
    EXECUTOR_SERVICE,
    REGISTRY_SERVICE,
    Release,
    configmap_env,
    container,
    container_env,
)
from tests.helm.local_pods import (
    AWS,
    BIN,
    clean_env,
    notes_forward_snippet,
    relocate,
    relocate_path,
    s3_client,
    start_serving,
)
from tests.registry.fixtures import write_adapter, write_base_model

# The registry tests' fixture: moto's S3 server.


def test_executor_fetches_its_model_loads_an_adapter_and_answers_forward(
    cpu: Release, start_server: Any, tmp_path: Path, s3_endpoint: str
) -> None:
    s3_secrets = {
        ("minio-credentials", "AWS_ACCESS_KEY_ID"): AWS["AWS_ACCESS_KEY_ID"],
        ("minio-credentials", "AWS_SECRET_ACCESS_KEY"): AWS["AWS_SECRET_ACCESS_KEY"],
    }
    checkpoint = write_base_model(tmp_path / "checkpoint")
    s3 = s3_client(s3_endpoint)
    s3.create_bucket(Bucket="models")
    for file in checkpoint.iterdir():
        s3.upload_file(str(file), "models", f"tiny-moe/{file.name}")

    # The init container: fetch_model.py from the image's /opt/moelora.
    statefulset = cpu.one("StatefulSet")
    fetch = container(statefulset, "fetch-model")
    assert fetch["command"] == ["python", "/opt/moelora/fetch_model.py"]
    fetch_env = relocate(container_env(cpu, fetch, s3_secrets), tmp_path)
    fetch_env["MOELORA_REGISTRY_S3_ENDPOINT_URL"] = s3_endpoint
    fetched = subprocess.run(
        [sys.executable, str(REPO / "docker" / "fetch_model.py")]
        + [relocate_path(arg, tmp_path) for arg in fetch["args"]],
        env=clean_env(fetch_env),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert fetched.returncode == 0, fetched.stderr
    assert (tmp_path / "models" / "model.safetensors").read_bytes() == (
        checkpoint / "model.safetensors"
    ).read_bytes()

    # The registry, with the base model and one adapter, uploaded as NOTES.txt says.
    registry_pod = container(cpu.one("Deployment", "registry"), "registry")
    registry_env = clean_env(relocate(container_env(cpu, registry_pod, {}), tmp_path))
    start_serving(
        start_server, ["moelora-registry", *registry_pod["args"]], REGISTRY_SERVICE, registry_env
    )
    executor_pod = container(statefulset, "executor")
    model_name = configmap_env(cpu, executor_pod)["MOELORA_EXECUTOR_BASE_MODEL_NAME"]
    operator_env = clean_env({"MOELORA_REGISTRY_ADDRESS": registry_env["MOELORA_REGISTRY_LISTEN"]})
    adapter = write_adapter(tmp_path / "my-adapter")
    for args in (
        ["base-model", "register", str(tmp_path / "models"), "--name", model_name],
        [
            *("upload", str(adapter), "--name", "my-adapter"),
            *("--base-model", model_name, "--alias", "prod"),
        ],
    ):
        done = subprocess.run(
            [str(BIN / "adapterctl"), *args],
            env=operator_env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr

    # The executor, from the StatefulSet's environment.
    env = relocate(container_env(cpu, executor_pod, {}), tmp_path)
    env["MOELORA_EXECUTOR_REGISTRY_ADDRESS"] = registry_env["MOELORA_REGISTRY_LISTEN"]
    env = clean_env(env)
    command = ["moelora-executor", *executor_pod.get("args", [])]
    executor = start_serving(start_server, command, EXECUTOR_SERVICE, env, timeout=120)

    # NOTES.txt's Forward call: first with the base model in every segment, then as
    # written, with the uploaded adapter.
    program = notes_forward_snippet(cpu.notes).replace(
        "127.0.0.1:50052", env["MOELORA_EXECUTOR_LISTEN"]
    )
    base_only = run_python(program.replace('"my-adapter@prod"', "None"))
    assert base_only.returncode == 0, base_only.stderr + executor.log()
    assert base_only.stdout.startswith("['', ''] (4, 16)"), base_only.stdout
    with_adapter = run_python(program)
    assert with_adapter.returncode == 0, with_adapter.stderr + executor.log()
    assert with_adapter.stdout.startswith("['my-adapter:1', ''] (4, 16)"), with_adapter.stdout
    assert executor.terminate() == 0


def run_python(program: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", program],
        env=clean_env({}),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
