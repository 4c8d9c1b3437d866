"""Start-up kernel configurations on a GPU: autotuned when the GPU has no table for the model,
cached on disk, reported by GetExecutorInfo; read back from the cache on the next start.

Skipped without CUDA. Run on the device with ``pytest tests/executor/test_kernel_configs.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.executor.conftest import Running, StartExecutor
from tests.executor.worlds import World

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _sources(running: Running) -> list[tuple[int, str, bool]]:
    info = running.client.get_executor_info()
    return [(c.rank, c.source, c.autotune_seconds > 0) for c in info.kernel_configs]


def test_autotuned_at_start_then_read_from_the_cache(
    qwen_world: World, start_executor: StartExecutor, tmp_path: Path
) -> None:
    settings = {"device": "cuda", "kernel_cache_dir": tmp_path, "kernel_autotune_seconds": 20}
    first = start_executor(qwen_world, **settings)
    assert _sources(first) == [(8, "autotuned", True), (0, "autotuned", True)]
    assert list(tmp_path.rglob("*.json")), "the tuned configurations are cached on disk"
    # The next start (another replica, or a restart) reads them instead of tuning again.
    second = start_executor(qwen_world, **settings)
    assert _sources(second) == [(8, "autotuned", False), (0, "autotuned", False)]
    off = {"device": "cuda", "kernel_cache_dir": tmp_path / "none", "kernel_autotune_seconds": 0}
    assert _sources(start_executor(qwen_world, **off)) == [
        (8, "heuristic", False),
        (0, "heuristic", False),
    ]
