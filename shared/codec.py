"""Tensors on the wire: ``moelora.v1.Tensor`` <-> numpy arrays and torch tensors.

The wire form is dtype + shape + raw little-endian row-major bytes. Decoding
checks that the byte length matches the shape and dtype and names the field
when it does not. Decoding is zero-copy (the result views the message's bytes
and is read-only); encoding copies once, into the ``bytes`` protobuf needs.

numpy has no bfloat16, so bfloat16 decodes only to torch; torch is imported
lazily, keeping this module usable by the registry, which has no torch.
"""

from __future__ import annotations

import math
import sys
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from moelora.v1 import tensor_pb2
from shared.errors import InvalidArgument

if TYPE_CHECKING:
    import torch

DataType = tensor_pb2.DataType
if TYPE_CHECKING:
    from typing import TypeAlias

    DataTypeCode: TypeAlias = tensor_pb2.DataType.ValueType

# torch views the wire bytes in place, which is only right on little-endian hosts
# (x86-64 and aarch64, everything we run on).
if sys.byteorder != "little":
    raise ImportError("shared.codec supports little-endian hosts only")


@dataclass(frozen=True)
class _WireType:
    name: str
    itemsize: int
    numpy: str | None  # little-endian numpy dtype string; None when numpy lacks it
    torch: str  # attribute name in the torch module


_WIRE_TYPES: dict[DataTypeCode, _WireType] = {
    DataType.DATA_TYPE_FLOAT32: _WireType("float32", 4, "<f4", "float32"),
    DataType.DATA_TYPE_FLOAT16: _WireType("float16", 2, "<f2", "float16"),
    DataType.DATA_TYPE_BFLOAT16: _WireType("bfloat16", 2, None, "bfloat16"),
    DataType.DATA_TYPE_FLOAT64: _WireType("float64", 8, "<f8", "float64"),
    DataType.DATA_TYPE_INT32: _WireType("int32", 4, "<i4", "int32"),
    DataType.DATA_TYPE_INT64: _WireType("int64", 8, "<i8", "int64"),
    DataType.DATA_TYPE_UINT8: _WireType("uint8", 1, "|u1", "uint8"),
    DataType.DATA_TYPE_BOOL: _WireType("bool", 1, "|b1", "bool"),
}
_BY_NAME = {w.name: code for code, w in _WIRE_TYPES.items()}


def dtype_name(dtype: DataTypeCode) -> str:
    """``DATA_TYPE_BFLOAT16`` -> ``"bfloat16"``; raises InvalidArgument for unknown codes."""
    return _wire_type(dtype, "dtype").name


def dtype_from_name(name: str) -> DataTypeCode:
    """``"bfloat16"`` (or ``"torch.bfloat16"``) -> ``DATA_TYPE_BFLOAT16``."""
    key = name.removeprefix("torch.")
    if key not in _BY_NAME:
        raise InvalidArgument(f"unsupported dtype {name!r}; use one of {sorted(_BY_NAME)}")
    return _BY_NAME[key]


def _wire_type(dtype: DataTypeCode, field: str) -> _WireType:
    wire = _WIRE_TYPES.get(dtype)
    if wire is None:
        allowed = ", ".join(DataType.Name(c) for c in _WIRE_TYPES)
        raise InvalidArgument(f"{field}: unsupported dtype {dtype}; use one of {allowed}", field)
    return wire


#: Limits of a decoded tensor: more is never a valid request, and a shape is checked before
#: anything is sized by it (a dimension of 2**63 with another of 0 holds no data at all).
MAX_DIMS = 8
MAX_ELEMENTS = 2**31 - 1


def _checked_shape(message: tensor_pb2.Tensor, field: str) -> tuple[tuple[int, ...], _WireType]:
    wire = _wire_type(message.dtype, f"{field}.dtype")
    if len(message.shape) > MAX_DIMS:
        raise InvalidArgument(
            f"{field}.shape: {len(message.shape)} dimensions; at most {MAX_DIMS}", f"{field}.shape"
        )
    shape = tuple(int(d) for d in message.shape)
    # Zero-size dimensions count as 1: strides multiply the others even when no data exists.
    if math.prod(max(d, 1) for d in shape) > MAX_ELEMENTS:
        raise InvalidArgument(
            f"{field}.shape: {list(shape)} has more than {MAX_ELEMENTS} elements",
            f"{field}.shape",
        )
    expected = math.prod(shape) * wire.itemsize
    if len(message.data) != expected:
        raise InvalidArgument(
            f"{field}.data: {len(message.data)} bytes, but shape {list(shape)} of {wire.name} "
            f"needs {expected}",
            f"{field}.data",
        )
    return shape, wire


def to_numpy(message: tensor_pb2.Tensor, field: str = "tensor") -> np.ndarray:
    """Decodes to a read-only numpy array viewing the message's bytes."""
    shape, wire = _checked_shape(message, field)
    if wire.numpy is None:
        raise InvalidArgument(f"{field}.dtype: {wire.name} has no numpy type; decode with to_torch")
    return np.frombuffer(message.data, dtype=np.dtype(wire.numpy)).reshape(shape)


def from_numpy(array: np.ndarray) -> tensor_pb2.Tensor:
    """Encodes a numpy array (any byte order or strides)."""
    code = dtype_from_name(array.dtype.name)
    wire = _WIRE_TYPES[code]
    assert wire.numpy is not None
    data = np.ascontiguousarray(array, dtype=np.dtype(wire.numpy)).tobytes()
    return tensor_pb2.Tensor(dtype=code, shape=list(array.shape), data=data)


def to_torch(
    message: tensor_pb2.Tensor, field: str = "tensor", device: str | torch.device | None = None
) -> torch.Tensor:
    """Decodes to a torch tensor. Without ``device`` the result views the message's
    bytes (read-only: copy before writing); with one it is copied there once."""
    import torch

    shape, wire = _checked_shape(message, field)
    dtype = getattr(torch, wire.torch)
    if not message.data:
        result = torch.empty(shape, dtype=dtype)
    else:
        with warnings.catch_warnings():
            # The view is read-only by design; torch warns about every such buffer.
            warnings.filterwarnings("ignore", message=".*not writable.*")
            flat = torch.frombuffer(message.data, dtype=torch.uint8)
        result = flat.view(dtype).reshape(shape)
    return result if device is None else result.to(device)


def from_torch(tensor: torch.Tensor) -> tensor_pb2.Tensor:
    """Encodes a torch tensor from any device, dtype included bfloat16."""
    name = str(tensor.dtype).removeprefix("torch.")
    code = dtype_from_name(name)
    wire = _WIRE_TYPES[code]
    host = tensor.detach().to("cpu").contiguous()
    raw = host.view(-1).view(_byte_view_dtype(wire.itemsize)).numpy()
    return tensor_pb2.Tensor(dtype=code, shape=list(tensor.shape), data=raw.tobytes())


def _byte_view_dtype(itemsize: int) -> torch.dtype:
    import torch

    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[itemsize]
