"""Tensors on the wire: ``moelora.v1.Tensor`` <-> numpy arrays (torch:
``moelora.client.torch_tensors``).

The wire form is dtype + shape + raw little-endian row-major bytes. Decoding
checks that the byte length matches the shape and dtype and names the field
when it does not. Decoding is zero-copy (the result views the message's bytes
and is read-only); encoding copies once, into the ``bytes`` protobuf needs.

numpy has no bfloat16, so bfloat16 decodes only to torch, in ``moelora.client.torch_tensors``; this
module imports no torch, so the registry (which has none) can use it.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from moelora.client.errors import InvalidArgument
from moelora.v1 import tensor_pb2

DataType = tensor_pb2.DataType
if TYPE_CHECKING:
    from typing import TypeAlias

    DataTypeCode: TypeAlias = tensor_pb2.DataType.ValueType

# torch views the wire bytes in place, which is only right on little-endian hosts
# (x86-64 and aarch64, everything we run on).
if sys.byteorder != "little":
    raise ImportError("moelora.client.tensors supports little-endian hosts only")


@dataclass(frozen=True)
class WireType:
    name: str
    itemsize: int
    numpy: str | None  # little-endian numpy dtype string; None when numpy lacks it
    torch: str  # attribute name in the torch module


WIRE_TYPES: dict[DataTypeCode, WireType] = {
    DataType.DATA_TYPE_FLOAT32: WireType("float32", 4, "<f4", "float32"),
    DataType.DATA_TYPE_FLOAT16: WireType("float16", 2, "<f2", "float16"),
    DataType.DATA_TYPE_BFLOAT16: WireType("bfloat16", 2, None, "bfloat16"),
    DataType.DATA_TYPE_FLOAT64: WireType("float64", 8, "<f8", "float64"),
    DataType.DATA_TYPE_INT32: WireType("int32", 4, "<i4", "int32"),
    DataType.DATA_TYPE_INT64: WireType("int64", 8, "<i8", "int64"),
    DataType.DATA_TYPE_UINT8: WireType("uint8", 1, "|u1", "uint8"),
    DataType.DATA_TYPE_BOOL: WireType("bool", 1, "|b1", "bool"),
}
_BY_NAME = {w.name: code for code, w in WIRE_TYPES.items()}


def dtype_name(dtype: DataTypeCode) -> str:
    """``DATA_TYPE_BFLOAT16`` -> ``"bfloat16"``; raises InvalidArgument for unknown codes."""
    return _wire_type(dtype, "dtype").name


def dtype_from_name(name: str) -> DataTypeCode:
    """``"bfloat16"`` (or ``"torch.bfloat16"``) -> ``DATA_TYPE_BFLOAT16``."""
    key = name.removeprefix("torch.")
    if key not in _BY_NAME:
        raise InvalidArgument(f"unsupported dtype {name!r}; use one of {sorted(_BY_NAME)}")
    return _BY_NAME[key]


def _wire_type(dtype: DataTypeCode, field: str) -> WireType:
    wire = WIRE_TYPES.get(dtype)
    if wire is None:
        allowed = ", ".join(DataType.Name(c) for c in WIRE_TYPES)
        raise InvalidArgument(f"{field}: unsupported dtype {dtype}; use one of {allowed}", field)
    return wire


#: Limits of a decoded tensor: more is never a valid request, and a shape is checked before
#: anything is sized by it (a dimension of 2**63 with another of 0 holds no data at all).
MAX_DIMS = 8
MAX_ELEMENTS = 2**31 - 1


def checked_shape(message: tensor_pb2.Tensor, field: str) -> tuple[tuple[int, ...], WireType]:
    """The message's shape and wire type, once its byte length is checked against them."""
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
    shape, wire = checked_shape(message, field)
    if wire.numpy is None:
        raise InvalidArgument(
            f"{field}.dtype: {wire.name} has no numpy type; decode with "
            "moelora.client.torch_tensors.to_torch"
        )
    return np.frombuffer(message.data, dtype=np.dtype(wire.numpy)).reshape(shape)


def from_numpy(array: np.ndarray) -> tensor_pb2.Tensor:
    """Encodes a numpy array (any byte order or strides)."""
    code = dtype_from_name(array.dtype.name)
    wire = WIRE_TYPES[code]
    assert wire.numpy is not None
    data = np.ascontiguousarray(array, dtype=np.dtype(wire.numpy)).tobytes()
    return tensor_pb2.Tensor(dtype=code, shape=list(array.shape), data=data)
