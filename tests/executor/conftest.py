"""Executors run in-process on 127.0.0.1 (real gRPC server, real client), over worlds of tiny
transformers models and PEFT adapters built once per session."""

from __future__ import annotations

import contextlib
import shutil
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from prometheus_client import CollectorRegistry

from executor_service.app import ExecutorApp
from executor_service.batch import KernelFn
from executor_service.config import ExecutorSettings
from executor_service.metrics import ExecutorMetrics
from executor_service.sources import AdapterFiles, AdapterSource, ResolvedAdapter
from executor_service.synthetic import (
    SyntheticAdapter,
    SyntheticBase,
    write_adapter,
    write_base_checkpoint,
)
from kernels import LoRAContext, MoELayerWeights, Routing, moe_forward
from kernels.synthetic import relative_error, worst_row_error
from moelora.client.executor import ExecutorClient, RetryPolicy
from moelora.client.model_spec import ModelSpec
from moelora.client.registry import RegistryClient
from shared.bench_servers import registry_server
from shared.bench_servers import write_adapter as write_bench_adapter
from shared.refs import AdapterRef
from tests.executor.worlds import LEGACY_2D, Recipe, World, build_world

#: The base model's name in the registry of ``registry_setup``.
BASE = "tiny"

#: float32 on the CPU: the executor's torch reference vs transformers + PEFT, both float32,
#: differ by rounding only (different summation orders): |Δ| <= ATOL + RTOL·|reference|.
ATOL = 1e-5
RTOL = 1e-4

#: The adapters of the shared qwen3_moe world: every PEFT variant, a legacy 2D one, and more
#: adapters than the executors' slots so that they must churn.
QWEN_RECIPES = [
    Recipe("alpha", "both", 1),
    Recipe("beta", "down_only", 2),
    Recipe("gamma", "rslora", 3),
    Recipe("delta", "target_modules", 4),
    Recipe("eps", "patterns", 5),
    Recipe("zeta", LEGACY_2D, 6),
    Recipe("eta", "gate_up_only", 7),
]
#: An adapter of the right format for a *different* base model (another hidden size).
FOREIGN = "foreign"
#: ``multi`` has two versions: 1 is a copy of alpha, 2 a copy of beta.
MULTI = "multi"


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), atol=ATOL, rtol=RTOL)


GPU = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
#: The kernels' own float32 tolerance on the GPU (tests/kernels): ‖Δ‖/‖reference‖ over the
#: output, and for its worst row.
GPU_FLOAT32_RELATIVE = 2e-5
GPU_FLOAT32_ROW = 1e-4


@dataclass(frozen=True)
class Placement:
    """Where an in-process executor computes, and how close it must come: the CPU's torch
    reference, or the GPU's Triton kernels in float32 replayed from CUDA graphs."""

    device: str

    @property
    def settings(self) -> dict[str, Any]:
        if self.device == "cpu":
            return {"device": "cpu"}
        return {"device": "cuda", "dtype": "float32", "cuda_graphs": "on"}

    def check(self, actual: torch.Tensor, expected: torch.Tensor) -> None:
        """``actual`` against a float32 reference (PEFT, or the same request alone)."""
        if self.device == "cpu":
            assert_close(actual, expected)  # elementwise ATOL + RTOL·|expected|
            return
        whole, worst = relative_error(actual, expected), worst_row_error(actual, expected)
        assert whole < GPU_FLOAT32_RELATIVE and worst < GPU_FLOAT32_ROW, (whole, worst)

    def same(self, merged: torch.Tensor, alone: torch.Tensor) -> None:
        """A request merged into a launch against it alone: the same bits on the CPU (fixed
        row blocks), the same within float32 rounding on the GPU (other tile configurations
        for other launch sizes)."""
        if self.device == "cpu":
            assert torch.equal(merged, alone)
        else:
            self.check(merged, alone)


@pytest.fixture(
    params=[
        pytest.param(Placement("cpu"), id="cpu"),
        pytest.param(Placement("cuda"), id="cuda-graphs", marks=GPU),
    ]
)
def placement(request: pytest.FixtureRequest) -> Placement:
    value: Placement = request.param
    return value


@pytest.fixture(scope="session")
def qwen_world(tmp_path_factory: pytest.TempPathFactory) -> World:
    root = tmp_path_factory.mktemp("qwen_world")
    world = build_world("qwen3_moe", root, QWEN_RECIPES)
    other = write_base_checkpoint(root / "other_base", SyntheticBase("qwen3_moe", hidden_size=32))
    write_adapter(world.adapter_dir / FOREIGN, other, SyntheticAdapter(rank=4))
    for version, source in ((1, "alpha"), (2, "beta")):
        shutil.copytree(world.adapter_dir / source, world.adapter_dir / MULTI / str(version))
    return world


@dataclass
class RegistrySetup:
    """A registry process (``--max-rank 8``) with a synthetic qwen3_moe base model registered
    as BASE, and a rank-8 adapter folder of it, not uploaded."""

    registry: str
    spec: ModelSpec
    checkpoint: Path
    adapter: Path


@dataclass
class Running:
    """An executor started by ``start_executor`` and a client connected to it."""

    app: ExecutorApp
    client: ExecutorClient
    registry: CollectorRegistry

    def metric(self, name: str, **labels: str) -> float:
        value = self.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value

    def slots(self) -> dict[str, int]:
        """name:VERSION -> slot of every adapter in a GPU slot."""
        listing = self.client.list_loaded_adapters()
        return {f"{a.name}:{a.version}": a.slot for a in listing.adapters if a.slot >= 0}


StartExecutor = Callable[..., Running]


@contextlib.contextmanager
def running_executor(
    world: World | RegistrySetup,
    *,
    kernel: KernelFn | None = None,
    source: AdapterSource | None = None,
    wait: bool = True,
    **overrides: Any,
) -> Iterator[Running]:
    """An executor on a free port over ``world`` (its adapter folder), or over a registry
    (``RegistrySetup``: adapters from it, a disk cache in a fresh folder), settings
    overridable, drained on exit. ``wait``: return once the base model loaded."""
    origin: dict[str, Any] = (
        {"adapter_dir": world.adapter_dir}
        if isinstance(world, World)
        else {
            "base_model_name": BASE,
            "registry_address": world.registry,
            "disk_cache_dir": world.checkpoint.parent / f"disk-{uuid.uuid4().hex[:8]}",
        }
    )
    values: dict[str, Any] = {
        "listen": "127.0.0.1:0",
        "base_model_path": world.checkpoint,
        **origin,
        # The float32 tolerances below hold for the CPU's torch reference; GPU serving has its
        # own tests (test_gpu_serving.py, test_stress.py) at bf16 tolerances.
        "device": "cpu",
        "num_slots": 4,
        "max_rank": 8,
        "host_cache_bytes": 64 * 1024**2,
        "metrics_listen": "",
        "drain_seconds": 5.0,
        "log_format": "text",
        # Autotuning belongs to its own tests (test_kernel_configs.py); here it would only
        # hold every GPU executor's start-up for its budget.
        "kernel_autotune_seconds": 0.0,
        **overrides,
    }
    registry = CollectorRegistry()
    app = ExecutorApp(ExecutorSettings(**values), ExecutorMetrics(registry), kernel, source)
    app.start()
    client = ExecutorClient(app.address, timeout=30, retry=RetryPolicy(attempts=1))
    try:
        if wait:
            # On a GPU the first start compiles every graph bucket's kernels (Triton's cache
            # keeps them for the next): a minute alone, more beside other test processes.
            assert app.loaded.wait(240), "the base model did not load within 240 s"
            assert app.load_error is None, app.load_error
        yield Running(app, client, registry)
    finally:
        client.close()
        app.drain()


@pytest.fixture
def start_executor() -> Iterator[StartExecutor]:
    """``start_executor(world, **kwargs)`` as ``running_executor``; drained at teardown."""
    with contextlib.ExitStack() as stack:
        yield lambda world, **kwargs: stack.enter_context(running_executor(world, **kwargs))


def slowed_kernel(seconds: float) -> KernelFn:
    """The torch reference, entered only after ``seconds``: a request holds its slots that
    long before the kernel reads them, so an overwrite in between would show in its output."""

    def kernel(
        hidden: torch.Tensor,
        layer: MoELayerWeights,
        lora: LoRAContext | None,
        routing: Routing | None,
    ) -> torch.Tensor:
        threading.Event().wait(seconds)
        return moe_forward(hidden, layer, lora, routing, backend="torch")

    return kernel


class GatedSource:
    """A real adapter source whose fetches are counted and can be held at a gate."""

    def __init__(self, inner: AdapterSource, gate: threading.Event | None = None) -> None:
        self._inner = inner
        self._gate = gate
        self._lock = threading.Lock()
        self.fetches: dict[str, int] = {}

    def resolve(self, ref: AdapterRef) -> ResolvedAdapter:
        return self._inner.resolve(ref)

    def resolve_at_once(self, ref: AdapterRef) -> ResolvedAdapter | None:
        return self._inner.resolve_at_once(ref)

    def cached(self) -> list[ResolvedAdapter]:
        return self._inner.cached()

    def close(self) -> None:
        self._inner.close()

    def fetch(self, adapter: ResolvedAdapter) -> AdapterFiles:
        with self._lock:
            self.fetches[adapter.label] = self.fetches.get(adapter.label, 0) + 1
        if self._gate is not None:
            assert self._gate.wait(30), "the test never opened the gate"
        return self._inner.fetch(adapter)


@pytest.fixture(scope="module")
def registry_setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RegistrySetup]:
    tmp = tmp_path_factory.mktemp("registry")
    spec = write_base_checkpoint(tmp / "base", SyntheticBase("qwen3_moe"), dtype=torch.bfloat16)
    write_bench_adapter(tmp / "adapter", spec, rank=8)
    with registry_server(tmp, ["--max-rank", "8"]) as address:
        with RegistryClient(address) as registry:
            registry.register_base_model(spec.to_proto(BASE))
        yield RegistrySetup(address, spec, tmp / "base", tmp / "adapter")
