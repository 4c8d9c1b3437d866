"""Kernel tests: on the CPU through Triton's interpreter, on a GPU when there is one.

tests/conftest.py sets TRITON_INTERPRET without a GPU, before any folder imports ``kernels``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from kernels.synthetic import relative_error, worst_row_error

#: Where the Triton path runs: the GPU if any, else the CPU interpreter.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Relative error ‖out − ref‖/‖ref‖ against the float32 reference, by operand dtype.
# float32 runs exact IEEE dots: only the summation order differs. fp16/bf16 round the
# activation (and the LoRA shrink result) to the operand dtype, as every fused MoE does:
# 2^-11 resp. 2^-8 relative per rounding, a few roundings deep.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
#: The same, for the worst single row (a row sums fewer roundings: its error varies more).
ROW_TOLERANCE = {torch.float32: 1e-4, torch.float16: 6e-3, torch.bfloat16: 4e-2}


def assert_rows_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Within TOLERANCE over the whole output and ROW_TOLERANCE in every row, for actual's
    dtype."""
    whole, worst = relative_error(actual, expected), worst_row_error(actual, expected)
    bound, row_bound = TOLERANCE[actual.dtype], ROW_TOLERANCE[actual.dtype]
    assert whole < bound and worst < row_bound, (
        f"{what}: rel err {whole:.2e} (< {bound:.0e}), worst row {worst:.2e} (< {row_bound:.0e})"
    )


@pytest.fixture
def poison_allocations(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Make ``torch.empty`` return NaN (floats) / huge values (ints), so a kernel that leaves
    part of a buffer unwritten and then reads or returns it fails the comparison."""
    real_empty = torch.empty

    def poisoned(*args: Any, **kwargs: Any) -> torch.Tensor:
        tensor = real_empty(*args, **kwargs)
        if tensor.dtype.is_floating_point:
            tensor.fill_(float("nan"))
        elif tensor.dtype in (torch.int32, torch.int64):
            tensor.fill_(2**30)
        return tensor

    monkeypatch.setattr(torch, "empty", poisoned)
    yield


def gpu_only(test: Callable[..., Any]) -> Any:
    """Mark a test as needing CUDA; it skips with a reason elsewhere."""
    test = pytest.mark.gpu(test)
    return pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")(test)
