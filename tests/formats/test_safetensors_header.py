"""The untrusted-safetensors header parser: real files pass, every lie is caught and named."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save, save_file

from moelora.client.errors import InvalidArgument
from moelora.client.safetensors_header import (
    TensorInfo,
    header_length,
    parse_bytes,
    parse_header,
    read_header,
)


def _file(header: object, data: bytes, pad: int = 0) -> bytes:
    text = json.dumps(header).encode() + b" " * pad
    return struct.pack("<Q", len(text)) + text + data


def _entry(dtype: str, shape: list[int], begin: int, end: int) -> dict[str, object]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def test_real_file_round_trip(tmp_path: Path) -> None:
    tensors: dict[str, np.ndarray[tuple[int, ...], np.dtype[np.generic]]] = {
        "b": np.arange(6, dtype=np.float32).reshape(2, 3),
        "a": np.ones((4,), dtype=np.float16),
        "empty": np.zeros((0, 5), dtype=np.int64),
        "scalar": np.array(3, dtype=np.int32),
    }
    blob = save(tensors, metadata={"format": "pt"})
    header = parse_bytes(blob)
    assert header.metadata == {"format": "pt"}
    assert header.tensors["b"].shape == (2, 3)
    assert header.tensors["b"].dtype == "F32"
    assert header.tensors["scalar"].shape == ()
    assert header.tensors["empty"].nbytes == 0
    assert header.file_size == len(blob)
    start = header.data_start + header.tensors["b"].begin
    got = np.frombuffer(blob, np.float32, 6, start).reshape(2, 3)
    np.testing.assert_array_equal(got, tensors["b"])
    path = tmp_path / "t.safetensors"
    save_file(tensors, path)
    assert read_header(path).tensors == parse_bytes(path.read_bytes()).tensors


def test_streaming_prefix_then_header() -> None:
    blob = save({"x": np.zeros((3, 4), np.float32)})
    n = header_length(blob[:8])
    header = parse_header(blob[8 : 8 + n])  # file size unknown while streaming
    assert header.tensors["x"] == TensorInfo("F32", (3, 4), 0, 48)
    assert header.data_start == 8 + n


@pytest.mark.parametrize(
    ("blob", "message"),
    [
        (b"\x10\x00\x00", "truncated"),
        (struct.pack("<Q", 1 << 40), "larger than the limit"),
        (struct.pack("<Q", 100) + b"{}", "truncated"),
        (_file({"x": _entry("F32", [4], 0, 16)}, b"\x00" * 10), "header says the file is"),
        (_file({"x": _entry("F32", [4], 0, 16)}, b"\x00" * 20), "4 bytes after the data section"),
        (_file({"x": _entry("F32", [4], 0, 12)}, b"\x00" * 12), "'x': data_offsets span 12"),
        (
            _file({"x": _entry("F32", [2], 0, 8), "y": _entry("F32", [2], 4, 12)}, b"\x00" * 12),
            "'y': data_offsets start at 4, which overlaps tensor 'x'",
        ),
        (
            _file({"x": _entry("F32", [2], 4, 12)}, b"\x00" * 12),
            "'x': data_offsets start at 4, which leaves a gap",
        ),
        (_file({"x": _entry("Q4", [2], 0, 2)}, b"\x00" * 2), "'x': unknown dtype 'Q4'"),
        (_file({"x": _entry("F32", [-1], 0, 0)}, b""), "'x': shape must be"),
        (_file({"x": _entry("F32", [True], 0, 4)}, b"\x00" * 4), "'x': shape must be"),
        (_file({"x": _entry("F32", [1], 8, 4)}, b"\x00" * 8), "'x': data_offsets must be"),
        (_file({"x": {"dtype": "F32", "shape": [1]}}, b""), "'x': header entry must have"),
        (_file({"__metadata__": {"a": 1}}, b""), "__metadata__ must map strings"),
        (_file([], b""), "does not start with"),
    ],
)
def test_rejects(blob: bytes, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        parse_bytes(blob)


def test_rejects_bad_json() -> None:
    for text in (b'{"x": NaN}', b'{"a": {}, "a": {}}', b"{" + b"[" * 100_000, b"{\xff}"):
        blob = struct.pack("<Q", len(text)) + text
        with pytest.raises(InvalidArgument, match=r"JSON|UTF-8"):
            parse_bytes(blob)


def test_padding_and_limit() -> None:
    blob = _file({"x": _entry("U8", [3], 0, 3)}, b"abc", pad=5)
    assert parse_bytes(blob).tensors["x"].nbytes == 3
    with pytest.raises(InvalidArgument, match="larger than the limit of 16"):
        parse_bytes(blob, max_header_bytes=16)


def test_file_errors_name_the_file(tmp_path: Path) -> None:
    path = tmp_path / "cut.safetensors"
    path.write_bytes(save({"x": np.zeros(8, np.float32)})[:-4])
    with pytest.raises(InvalidArgument, match=r"cut.safetensors: safetensors data truncated"):
        read_header(path)
