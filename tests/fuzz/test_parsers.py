"""Property tests of what parses untrusted bytes: the tensor codec, the safetensors header
parser, adapter references and the adapter-format parser. Whatever the input, each either
answers or raises InvalidArgument (a MoeLoraError: a status code a client can act on) with a
bounded message; valid input round-trips exactly."""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from moelora.client import tensors as codec
from moelora.client import torch_tensors as torch_codec
from moelora.client.errors import InvalidArgument, MoeLoraError
from moelora.client.model_spec import read_model_spec
from moelora.client.safetensors_header import DTYPE_ITEMSIZE, parse_bytes
from moelora.v1 import tensor_pb2
from shared.adapter_format import inspect_adapter, parse_adapter_config
from shared.refs import AdapterRef
from tests.registry.fixtures import write_adapter, write_base_model

#: Error messages travel in the grpc-message trailer: they must stay short whatever the input.
MAX_MESSAGE = 1024

DTYPES = [c for c in tensor_pb2.DataType.values() if c != 0]


def _refused(exc: MoeLoraError) -> None:
    assert isinstance(exc, InvalidArgument), exc
    assert len(exc.message) <= MAX_MESSAGE, len(exc.message)


# -- tensor codec ---------------------------------------------------------------------------

wire_tensors = st.builds(
    tensor_pb2.Tensor,
    dtype=st.integers(-2, 12),
    shape=st.lists(
        st.one_of(st.integers(0, 8), st.integers(0, 2**64 - 1)), min_size=0, max_size=70
    ),
    data=st.binary(max_size=256),
)


@given(wire_tensors)
def test_codec_decodes_or_refuses_any_message(message: tensor_pb2.Tensor) -> None:
    try:
        tensor = torch_codec.to_torch(message, "hidden_states")
    except MoeLoraError as exc:
        _refused(exc)
        return
    assert tensor.numel() * tensor.element_size() == len(message.data)
    assert list(tensor.shape) == list(message.shape)


@given(
    st.sampled_from(["float32", "float16", "bfloat16", "float64", "int32", "int64", "uint8"]),
    st.lists(st.integers(0, 5), min_size=0, max_size=4),
    st.integers(0, 2**32 - 1),
)
def test_codec_round_trips_exactly(dtype: str, shape: list[int], seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=generator, dtype=torch.float64) * 100
    tensor = values.to(getattr(torch, dtype))
    back = torch_codec.to_torch(torch_codec.from_torch(tensor))
    assert back.dtype == tensor.dtype and back.shape == tensor.shape
    assert torch.equal(back, tensor)


def test_codec_caps_dimensions_and_elements() -> None:
    f32 = tensor_pb2.DATA_TYPE_FLOAT32
    with pytest.raises(InvalidArgument, match="9 dimensions; at most 8"):
        torch_codec.to_torch(tensor_pb2.Tensor(dtype=f32, shape=[1] * 9, data=b"\0" * 4))
    with pytest.raises(InvalidArgument, match="elements"):
        torch_codec.to_torch(tensor_pb2.Tensor(dtype=f32, shape=[2**31, 0], data=b""))
    # Zero-size with huge others: no data, but still refused (strides would overflow).
    for shape in ([0, 2**63], [0, 6, 100, 123976774, 123993279]):
        with pytest.raises(InvalidArgument):
            torch_codec.to_torch(tensor_pb2.Tensor(dtype=f32, shape=shape, data=b""))


# -- safetensors header ----------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
entries = st.fixed_dictionaries(
    {
        "dtype": st.sampled_from([*DTYPE_ITEMSIZE, "F8", "x"]),
        "shape": st.lists(st.integers(-1, 2**40), max_size=4),
        "data_offsets": st.lists(st.integers(-1, 2**40), min_size=0, max_size=3),
    }
)
headers = st.dictionaries(st.text(max_size=12), entries | json_values, max_size=5)


@given(headers, st.binary(max_size=64), st.integers(-8, 8))
def test_safetensors_parser_accepts_or_refuses(
    header: dict[str, Any], data: bytes, length_delta: int
) -> None:
    text = json.dumps(header).encode()
    blob = struct.pack("<Q", max(0, len(text) + length_delta)) + text + data
    try:
        parsed = parse_bytes(blob)
    except MoeLoraError as exc:
        _refused(exc)
        return
    assert parsed.file_size == len(blob)


@given(st.binary(max_size=300))
def test_safetensors_parser_on_raw_bytes(blob: bytes) -> None:
    try:
        parse_bytes(blob)
    except MoeLoraError as exc:
        _refused(exc)


# -- references ------------------------------------------------------------------------------

ref_text = st.one_of(
    st.text(max_size=40),
    st.text(alphabet="ab.:@/\\\0-_٣²", max_size=20),
    st.builds(lambda n, v: f"{n}:{v}", st.text("abc", min_size=1, max_size=4), st.text(max_size=6)),
    st.text(min_size=5000, max_size=6000, alphabet="a/"),
)


@given(ref_text)
def test_references_parse_or_refuse(text: str) -> None:
    try:
        ref = AdapterRef.parse(text, "adapter")
    except MoeLoraError as exc:
        _refused(exc)
        return
    assert "/" not in ref.name and "\0" not in ref.name and ".." not in ref.name
    assert AdapterRef.parse(str(ref)) == ref
    if ref.version is not None:
        assert text.strip().split(":")[1].isascii()


# -- adapter format --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def adapter_parts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, dict[str, Any], bytes]:
    root = tmp_path_factory.mktemp("fuzz_adapter")
    spec = read_model_spec(write_base_model(root / "base"))
    folder = write_adapter(root / "adapter")
    config = json.loads((folder / "adapter_config.json").read_text())
    return spec, config, (folder / "adapter_model.safetensors").read_bytes()


config_changes = st.dictionaries(
    st.sampled_from(
        [
            "r",
            "lora_alpha",
            "use_rslora",
            "target_parameters",
            "target_modules",
            "rank_pattern",
            "alpha_pattern",
            "peft_type",
        ]
    ),
    json_values,
    max_size=3,
)


@given(config_changes, st.integers(0, 2**16), st.integers(0, 255), st.integers(8, 2**20))
def test_adapter_format_accepts_or_refuses(
    adapter_parts: tuple[Any, dict[str, Any], bytes],
    changes: dict[str, Any],
    flip_at: int,
    flip_to: int,
    max_rank: int,
) -> None:
    spec, config, weights = adapter_parts
    mutated = bytearray(weights)
    mutated[flip_at % len(mutated)] = flip_to
    try:
        parsed_config = parse_adapter_config(json.dumps({**config, **changes}).encode())
        header = parse_bytes(bytes(mutated))
        inspect_adapter(parsed_config, header, spec, max_rank)
    except MoeLoraError as exc:
        _refused(exc)


def test_numpy_dtype_names_have_wire_types() -> None:
    for name in ("float32", "float16", "float64", "int32", "int64", "uint8", "bool"):
        assert codec.to_numpy(codec.from_numpy(np.zeros(2, dtype=name))).dtype == name
