"""Where untrusted safetensors headers are parsed and checked (no torch).

A safetensors file is an 8-byte little-endian header length N, N bytes of UTF-8 JSON
(``{"name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ...,
"__metadata__": {"k": "v"}}``, possibly padded with spaces), then the data section. Offsets are
relative to the data section. The checks follow the reference (Rust) implementation: known
dtypes, non-negative shapes, ``end - begin == prod(shape) * itemsize``, tensors contiguous and
non-overlapping from byte 0, and — when the file size is known — a data section that ends
exactly at the end of the file.

The parser works from the first bytes of a stream (``header_length`` on an 8-byte prefix, then
``parse_header`` on the next N bytes), so a server can reject a bad upload before the body
arrives. Every problem raises ``InvalidArgument`` naming the tensor and what is wrong.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from moelora.client.errors import InvalidArgument

#: Bytes of the length prefix.
PREFIX_BYTES = 8
#: Default limit on the JSON header. The reference implementation allows 100 MB; real
#: checkpoints and adapters stay far below 16 MiB (a 60k-tensor shard is ~6 MiB).
DEFAULT_MAX_HEADER_BYTES = 16 * 1024 * 1024

#: Bytes per element of every dtype the reference implementation names (sub-byte
#: float4/float6 types excluded: nothing we serve uses them).
DTYPE_ITEMSIZE: Mapping[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "F8_E5M2FNUZ": 1,
    "F8_E4M3FNUZ": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
    "C64": 8,
}

METADATA_KEY = "__metadata__"


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's entry; ``begin``/``end`` are byte offsets into the data section."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class SafetensorsHeader:
    """A checked header. ``data_start`` is the file offset of the data section."""

    tensors: Mapping[str, TensorInfo]
    metadata: Mapping[str, str]
    data_start: int
    data_size: int

    @property
    def file_size(self) -> int:
        return self.data_start + self.data_size


def header_length(
    prefix: bytes | memoryview, max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
) -> int:
    """N, the JSON header's length, from the first (at least 8) bytes of a file."""
    if len(prefix) < PREFIX_BYTES:
        raise InvalidArgument(
            f"safetensors data truncated: {len(prefix)} bytes, the length prefix alone is "
            f"{PREFIX_BYTES}"
        )
    length = int.from_bytes(prefix[:PREFIX_BYTES], "little")
    if length > max_header_bytes:
        raise InvalidArgument(
            f"safetensors header is {length} bytes, larger than the limit of {max_header_bytes}"
        )
    if length < 2:
        raise InvalidArgument(f"safetensors header length {length} is too small for a JSON object")
    return length


def parse_header(
    header_bytes: bytes | memoryview,
    file_size: int | None = None,
    *,
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES,
) -> SafetensorsHeader:
    """Check the N header bytes that follow the prefix.

    ``file_size`` is the whole file's size when known; then the data section must end exactly
    at the end of the file. Without it (streaming) only the header's own consistency is checked.
    """
    if len(header_bytes) > max_header_bytes:
        raise InvalidArgument(
            f"safetensors header is {len(header_bytes)} bytes, larger than the limit of "
            f"{max_header_bytes}"
        )
    raw = _load_json(bytes(header_bytes))
    data_start = PREFIX_BYTES + len(header_bytes)
    metadata = _check_metadata(raw.pop(METADATA_KEY, {}))
    tensors = {name: _check_entry(name, entry) for name, entry in raw.items()}
    data_size = _check_layout(tensors)
    if file_size is not None:
        if file_size < data_start + data_size:
            raise InvalidArgument(
                f"safetensors data truncated: the header says the file is "
                f"{data_start + data_size} bytes but it has {file_size}"
            )
        if file_size > data_start + data_size:
            raise InvalidArgument(
                f"safetensors file has {file_size - data_start - data_size} bytes after the "
                f"data section the header describes ({data_start + data_size} bytes)"
            )
    return SafetensorsHeader(tensors, metadata, data_start, data_size)


def parse_bytes(
    data: bytes | memoryview, *, max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
) -> SafetensorsHeader:
    """Check a whole safetensors file held in memory."""
    length = header_length(data, max_header_bytes)
    if len(data) < PREFIX_BYTES + length:
        raise InvalidArgument(
            f"safetensors data truncated: the header alone is {length} bytes but only "
            f"{len(data) - PREFIX_BYTES} follow the length prefix"
        )
    header = memoryview(data)[PREFIX_BYTES : PREFIX_BYTES + length]
    return parse_header(header, len(data), max_header_bytes=max_header_bytes)


def read_header(
    path: Path, *, max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
) -> SafetensorsHeader:
    """Check the header of a file on disk, reading only the header bytes."""
    size = path.stat().st_size
    with path.open("rb") as f:
        length = header_length(f.read(PREFIX_BYTES), max_header_bytes)
        header = f.read(length)
    if len(header) < length:
        raise InvalidArgument(
            f"{path.name}: safetensors data truncated: the header is {length} bytes but only "
            f"{len(header)} follow the length prefix"
        )
    try:
        return parse_header(header, size, max_header_bytes=max_header_bytes)
    except InvalidArgument as err:
        raise InvalidArgument(f"{path.name}: {err.message}") from None


def _reject_constant(token: str) -> float:
    raise ValueError(f"{token} is not valid JSON")


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    result: dict[str, object] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {key!r}")
        result[key] = value
    return result


def _load_json(header: bytes) -> dict[str, object]:
    if not header.startswith(b"{"):
        raise InvalidArgument("safetensors header does not start with '{'")
    try:
        text = header.decode("utf-8")
        # Trailing spaces are the format's alignment padding.
        raw = json.loads(
            text.rstrip(" "), object_pairs_hook=_unique_keys, parse_constant=_reject_constant
        )
    except UnicodeDecodeError:
        raise InvalidArgument("safetensors header is not valid UTF-8") from None
    except (ValueError, RecursionError) as err:
        raise InvalidArgument(f"safetensors header is not valid JSON: {err}") from None
    if not isinstance(raw, dict):
        raise InvalidArgument("safetensors header is not a JSON object")
    return raw


def _check_metadata(raw: object) -> dict[str, str]:
    if not isinstance(raw, dict) or not all(isinstance(v, str) for v in raw.values()):
        raise InvalidArgument(f"safetensors {METADATA_KEY} must map strings to strings")
    return raw


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_entry(name: str, entry: object) -> TensorInfo:
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise InvalidArgument(
            f"tensor {name!r}: header entry must have exactly dtype, shape and data_offsets"
        )
    dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPE_ITEMSIZE:
        raise InvalidArgument(f"tensor {name!r}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise InvalidArgument(f"tensor {name!r}: shape must be a list of non-negative integers")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(_is_int(o) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise InvalidArgument(
            f"tensor {name!r}: data_offsets must be [begin, end], 0 <= begin <= end"
        )
    info = TensorInfo(dtype, tuple(shape), offsets[0], offsets[1])
    expected = info.numel * DTYPE_ITEMSIZE[dtype]
    if info.nbytes != expected:
        raise InvalidArgument(
            f"tensor {name!r}: data_offsets span {info.nbytes} bytes but {dtype} {list(shape)} "
            f"needs {expected}"
        )
    return info


def _check_layout(tensors: Mapping[str, TensorInfo]) -> int:
    """Tensors must tile the data section from byte 0 without gaps or overlaps; its size."""
    end, previous = 0, None
    for name, info in sorted(tensors.items(), key=lambda item: (item[1].begin, item[1].end)):
        if info.begin != end:
            what = "overlaps" if info.begin < end else "leaves a gap after"
            after = f"tensor {previous!r}" if previous is not None else "the data section start"
            raise InvalidArgument(
                f"tensor {name!r}: data_offsets start at {info.begin}, which {what} {after} "
                f"(ending at {end})"
            )
        end, previous = info.end, name
    return end
