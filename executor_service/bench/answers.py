"""How benchmark clients check answers: wire tensors to float32, and the worst row's error.

numpy only, so that client processes start fast and never touch the GPU.
"""

from __future__ import annotations

import math

import numpy as np

from moelora.v1 import tensor_pb2

#: bf16 on a GPU: a merged launch or a padded CUDA-graph bucket picks other tile
#: configurations than the request alone (other rounding orders); each stays within the
#: kernels' bf16 bound of the same float64 reference, as the parity tests require.
GPU_ROW_TOLERANCE = 3e-2
#: float32 on the CPU: merged and alone are the same arithmetic row by row.
CPU_ROW_TOLERANCE = 1e-5


def row_tolerance(device: str) -> float:
    return CPU_ROW_TOLERANCE if device == "cpu" else GPU_ROW_TOLERANCE


def bf16_bytes(values: np.ndarray) -> bytes:
    """float32 values rounded (truncated) to bfloat16, little-endian."""
    return (values.astype(np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()


def bf16_to_float32(data: bytes | memoryview | np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    raw = np.frombuffer(data, dtype="<u2") if not isinstance(data, np.ndarray) else data
    return (raw.astype(np.uint32) << 16).view(np.float32).reshape(shape)


def tensor_to_float32(tensor: tensor_pb2.Tensor) -> np.ndarray:
    """A bfloat16 or float32 wire tensor as float32."""
    shape = tuple(tensor.shape)
    if tensor.dtype == tensor_pb2.DATA_TYPE_BFLOAT16:
        return bf16_to_float32(tensor.data, shape)
    if tensor.dtype == tensor_pb2.DATA_TYPE_FLOAT32:
        return np.frombuffer(tensor.data, dtype="<f4").reshape(shape)
    raise ValueError(f"unexpected output dtype {tensor.dtype}")


def worst_row_error(actual: np.ndarray, expected: np.ndarray) -> float:
    """max over rows of ‖actual_row − expected_row‖ / ‖expected_row‖ (in float64); inf for a
    shape mismatch or any non-finite value, so that those never pass. Per row, not one norm
    over the whole output: a lost or shifted row shows whatever the other rows hold."""
    if actual.shape != expected.shape or actual.ndim != 2:
        return math.inf
    a, e = actual.astype(np.float64), expected.astype(np.float64)
    if not (np.isfinite(a).all() and np.isfinite(e).all()):
        return math.inf
    diff = np.linalg.norm(a - e, axis=1)
    scale = np.maximum(np.linalg.norm(e, axis=1), 1e-30)
    return float((diff / scale).max()) if len(diff) else 0.0
