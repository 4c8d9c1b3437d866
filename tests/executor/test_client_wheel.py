"""The ``moelora-client`` wheel as another team gets it: built from this repository, installed
into a fresh virtual environment without torch (offline, from the wheels ``make setup`` keeps
in ``.venv/wheelhouse``), it holds only the ``moelora`` namespace, a user's script passes
``mypy --strict`` with Forward typed, and the script runs against a live executor."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest

from tests.executor.conftest import StartExecutor, assert_close
from tests.executor.worlds import World

REPO = Path(__file__).resolve().parents[2]
WHEELHOUSE = Path(sys.prefix) / "wheelhouse"

pytestmark = pytest.mark.timeout(300)

SCRIPT = '''
"""A backend's call: numpy in, numpy out."""

import json
import sys

import numpy as np
import numpy.typing as npt

from moelora.client import ExecutorClient, NotFound


def main(address: str, hidden_path: str) -> None:
    hidden: npt.NDArray[np.float32] = np.load(hidden_path)
    with ExecutorClient(address, timeout=30) as client:
        layer = client.get_executor_info().base_model.moe_layers[0]
        result = client.forward(layer, hidden, segments=[(4, None), (len(hidden) - 4, "alpha")])
        try:
            client.forward(layer, hidden, segments=[(len(hidden), "nosuch")])
            missing = ""
        except NotFound as exc:
            missing = exc.message
    output: npt.NDArray[np.float32] = result.output
    np.save(hidden_path + ".out.npy", output)
    print(json.dumps({"adapters": result.resolved_adapters, "missing": missing}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
'''

#: Lines mypy must type, and one it must refuse: proof that Forward is not Any.
PROBE = """
import numpy as np
from moelora.client import ExecutorClient

client = ExecutorClient("127.0.0.1:1")
reveal_type(client.forward(3, np.zeros((1, 4), dtype=np.float32)))
client.forward("3", np.zeros((1, 4), dtype=np.float32))
"""


def _run(*args: str | Path, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    # Without PYTHONPATH: the fresh venv sees nothing of this checkout but the wheel.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [str(a) for a in args], capture_output=True, text=True, timeout=240, cwd=cwd, env=env
    )


@pytest.fixture(scope="module")
def client_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the wheel and its dependencies (no torch), offline."""
    assert WHEELHOUSE.is_dir(), f"{WHEELHOUSE} is missing: run `make setup`"
    root = tmp_path_factory.mktemp("client_venv")
    built = _run(
        sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
        REPO / "client", "--wheel-dir", root / "dist",
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    (wheel,) = (root / "dist").glob("moelora_client-*.whl")
    venv = root / "venv"
    assert _run(sys.executable, "-m", "venv", "--without-pip", venv).returncode == 0
    installed = _run(
        sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install", "--quiet",
        "--no-index", "--find-links", WHEELHOUSE, wheel,
    )  # fmt: skip
    assert installed.returncode == 0, installed.stderr
    return venv


def _site_packages(venv: Path) -> Path:
    (found,) = (venv / "lib").glob("python3*/site-packages")
    return found


def test_the_wheel_installs_only_the_moelora_namespace(client_venv: Path) -> None:
    site = _site_packages(client_venv)
    ours = metadata.Distribution.at(next(site.glob("moelora_client-*.dist-info")))
    tops = {Path(str(f)).parts[0] for f in ours.files or ()}
    assert tops == {"moelora", ours._path.name}  # type: ignore[attr-defined]
    assert not (site / "moelora" / "__init__.py").exists()  # a namespace others may share
    probe = _run(
        client_venv / "bin" / "python", "-I", "-c",
        "import importlib.util as u; print([m for m in ('shared', 'kernels', 'torch', "
        "'executor_service', 'registry_service') if u.find_spec(m)])",
    )  # fmt: skip
    assert probe.stdout.strip() == "[]", probe.stderr


def test_the_server_distribution_cannot_collide_where_it_is_installed() -> None:
    """The server distribution still has top-level ``shared`` and ``kernels``: it is installed
    only into the services' own images (users install moelora-client), and there no other
    distribution provides those names. This environment holds every extra the images do."""
    providers = metadata.packages_distributions()
    for name in ("shared", "kernels", "registry_service", "executor_service"):
        assert set(providers.get(name, ())) == {"moe-lora-serve"}, (name, providers.get(name))


def test_a_typed_script_passes_mypy_strict_and_runs_against_a_live_executor(
    client_venv: Path, qwen_world: World, start_executor: StartExecutor, tmp_path: Path
) -> None:
    script = tmp_path / "backend.py"
    script.write_text(textwrap.dedent(SCRIPT))
    probe = tmp_path / "probe.py"
    probe.write_text(textwrap.dedent(PROBE))
    python = client_venv / "bin" / "python"
    mypy = (sys.executable, "-m", "mypy", "--python-executable", python, "--no-incremental")
    strict = _run(*mypy, "--strict", script, cwd=tmp_path)
    assert strict.returncode == 0, strict.stdout + strict.stderr
    checked = _run(*mypy, "--strict", probe, cwd=tmp_path)
    assert 'Revealed type is "moelora.client.executor.ForwardResult[numpy.ndarray' in (
        checked.stdout
    ), checked.stdout
    assert 'Argument 1 to "forward" of "ExecutorClient" has incompatible type "str"' in (
        checked.stdout
    ), checked.stdout

    running = start_executor(qwen_world)
    layer = qwen_world.moe_layers[0]
    hidden = qwen_world.inputs[layer].numpy()
    np.save(tmp_path / "hidden.npy", hidden)
    done = _run(python, script, running.app.address, tmp_path / "hidden.npy")
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    assert answer["adapters"] == ["", "alpha:1"]
    assert "nosuch" in answer["missing"]
    output = np.load(tmp_path / "hidden.npy.out.npy")
    segments: list[tuple[int, str | None]] = [(4, None), (len(hidden) - 4, "alpha")]
    import torch

    assert_close(torch.from_numpy(output), qwen_world.expected(layer, segments))
