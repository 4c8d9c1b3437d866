"""The tensor codec: round trips for every dtype and odd shapes, zero-copy decode,
and refusal of byte lengths that do not match shape x dtype."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moelora.client import tensors as codec
from moelora.client import torch_tensors as torch_codec
from moelora.client.errors import InvalidArgument
from moelora.v1 import tensor_pb2

DT = tensor_pb2.DataType
TORCH_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
]
SHAPES = [(), (0,), (1,), (7,), (3, 5), (2, 0, 4), (1, 1, 1, 3), (13, 17)]


def _random(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype.is_floating_point:
        values = torch.randn(shape, generator=gen, dtype=torch.float64) * 1e3
        return values.to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(
        max(info.min, -(2**31)), min(info.max, 2**31 - 1), shape, generator=gen
    ).to(dtype)


def _bits(tensor: torch.Tensor) -> list[int]:
    return tensor.contiguous().reshape(-1).view(torch.uint8).tolist()


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_torch_round_trip_is_bit_exact(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(hash((str(dtype), shape)) % 2**31)
    original = _random(shape, dtype, gen)
    message = torch_codec.from_torch(original)
    assert list(message.shape) == list(shape)
    assert len(message.data) == original.numel() * original.element_size()
    decoded = torch_codec.to_torch(tensor_pb2.Tensor.FromString(message.SerializeToString()))
    assert decoded.dtype == dtype and tuple(decoded.shape) == shape
    # Compare bits, not values: NaN payloads and -0.0 must survive too.
    assert _bits(decoded) == _bits(original)


def test_bfloat16_special_values_survive() -> None:
    original = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-40, 3.0e38])
    decoded = torch_codec.to_torch(torch_codec.from_torch(original.bfloat16()))
    assert torch.equal(decoded.view(torch.int16), original.bfloat16().view(torch.int16))


def test_wire_bytes_are_little_endian_row_major() -> None:
    message = torch_codec.from_torch(torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float32))
    assert message.data == np.array([1, 2, 3, 4], dtype="<f4").tobytes()
    assert message.dtype == DT.DATA_TYPE_FLOAT32
    bf16 = torch_codec.from_torch(torch.tensor([1.0], dtype=torch.bfloat16))
    assert bf16.data == bytes([0x80, 0x3F])  # 0x3F80, the top half of float32 1.0


def test_non_contiguous_and_strided_inputs_encode_in_logical_order() -> None:
    base = torch.arange(24, dtype=torch.float16).reshape(4, 6)
    view = base.t()[1:5:2]
    decoded = torch_codec.to_torch(torch_codec.from_torch(view))
    assert torch.equal(decoded, view.contiguous())


@pytest.mark.parametrize(
    "dtype", [np.float32, np.float16, np.float64, np.int32, np.int64, np.uint8, np.bool_]
)
def test_numpy_round_trip(dtype: type) -> None:
    rng = np.random.default_rng(0)
    array: np.ndarray = (rng.standard_normal((5, 3)) * 100).astype(dtype)
    decoded = codec.to_numpy(codec.from_numpy(array))
    assert decoded.dtype == np.dtype(dtype)
    assert decoded.tobytes() == array.tobytes()


def test_numpy_big_endian_input_is_converted() -> None:
    array = np.arange(6, dtype=">f4").reshape(2, 3)
    message = codec.from_numpy(array)
    assert message.data == array.astype("<f4").tobytes()


def test_decode_views_the_message_bytes() -> None:
    message = torch_codec.from_torch(torch.arange(8, dtype=torch.float32))
    array = codec.to_numpy(message)
    assert not array.flags.writeable  # a view of immutable bytes, not a copy
    assert array.base is not None


@pytest.mark.parametrize("delta", [-1, 1, -4])
def test_wrong_byte_length_is_rejected_naming_the_field(delta: int) -> None:
    good = torch_codec.from_torch(torch.zeros(3, 4, dtype=torch.bfloat16))
    data = good.data[: len(good.data) + delta] if delta < 0 else good.data + b"\0" * delta
    bad = tensor_pb2.Tensor(dtype=good.dtype, shape=good.shape, data=data)
    with pytest.raises(
        InvalidArgument, match=r"hidden_states\.data: .*shape \[3, 4\] of bfloat16 needs 24"
    ):
        torch_codec.to_torch(bad, field="hidden_states")
    with pytest.raises(InvalidArgument, match=r"hidden_states\.data"):
        codec.to_numpy(
            tensor_pb2.Tensor(dtype=DT.DATA_TYPE_FLOAT32, shape=[2], data=b"\0" * 7),
            "hidden_states",
        )


def test_unspecified_dtype_is_rejected() -> None:
    with pytest.raises(InvalidArgument, match=r"x\.dtype: unsupported dtype 0"):
        torch_codec.to_torch(tensor_pb2.Tensor(shape=[1], data=b"\0" * 4), field="x")


def test_bfloat16_to_numpy_says_to_use_torch() -> None:
    with pytest.raises(InvalidArgument, match="to_torch"):
        codec.to_numpy(torch_codec.from_torch(torch.ones(2, dtype=torch.bfloat16)))


def test_to_torch_with_device_copies() -> None:
    message = torch_codec.from_torch(torch.ones(4))
    tensor = torch_codec.to_torch(message, device="cpu")
    tensor += 1  # a copy is writable
    assert torch_codec.to_torch(message).tolist() == [1.0] * 4


def test_dtype_names() -> None:
    assert codec.dtype_name(DT.DATA_TYPE_BFLOAT16) == "bfloat16"
    assert codec.dtype_from_name("torch.float16") == DT.DATA_TYPE_FLOAT16
    with pytest.raises(InvalidArgument, match="complex64"):
        codec.dtype_from_name("complex64")
