"""The benchmarks' answer check sees what one norm over the whole output would miss."""

from __future__ import annotations

import math

import numpy as np

from executor_service.bench.answers import (
    GPU_ROW_TOLERANCE,
    bf16_bytes,
    bf16_to_float32,
    worst_row_error,
)


def _output(rows: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, 256), dtype=np.float32)


def test_a_zeroed_last_row_fails_though_the_whole_norm_passes() -> None:
    expected = _output(4096)
    actual = expected.copy()
    actual[-1] = 0.0
    whole = float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))
    assert whole < GPU_ROW_TOLERANCE  # what a single norm would have let through
    assert worst_row_error(actual, expected) == 1.0


def test_shifted_rows_fail() -> None:
    expected = _output(64)
    assert worst_row_error(np.roll(expected, 1, axis=0), expected) > 1.0


def test_non_finite_values_and_wrong_shapes_never_pass() -> None:
    expected = _output(8)
    actual = expected.copy()
    actual[3, 7] = np.nan
    assert worst_row_error(actual, expected) == math.inf
    assert worst_row_error(expected[:7], expected) == math.inf


def test_bf16_rounding_stays_within_the_gpu_tolerance_and_round_trips() -> None:
    values = _output(16, seed=1)
    rounded = bf16_to_float32(bf16_bytes(values), values.shape)
    assert 0 < worst_row_error(rounded, values) < GPU_ROW_TOLERANCE
    assert np.array_equal(bf16_to_float32(bf16_bytes(rounded), values.shape), rounded)
