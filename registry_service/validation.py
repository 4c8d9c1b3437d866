"""Where an uploaded adapter is checked before it may become READY: the
config parses, the safetensors header is sound and matches the file size,
every tensor fits the registered base model at a rank within the limit, and
no weight is NaN or infinite. The format rules live in shared/ (the executor
applies the same ones); this module runs them over spooled files and says
which file a problem is in."""

from __future__ import annotations

import mmap
from pathlib import Path

from moelora.client.adapter_files import CONFIG_FILE, WEIGHTS_FILE
from moelora.client.errors import InvalidArgument
from moelora.client.model_spec import ModelSpec
from moelora.client.safetensors_header import (
    DEFAULT_MAX_HEADER_BYTES,
    PREFIX_BYTES,
    header_length,
    parse_header,
    read_header,
)
from registry_service.domain import AdapterSummary
from shared.adapter_format import (
    AdapterFormat,
    check_finite,
    check_scaled,
    inspect_adapter,
    parse_adapter_config,
)

#: How much of a file's start the early check may need: the length prefix and
#: the largest header accepted.
HEAD_BYTES = PREFIX_BYTES + DEFAULT_MAX_HEADER_BYTES

_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}
_FORMATS = {AdapterFormat.TARGET_PARAMETERS: "peft_3d", AdapterFormat.PER_EXPERT: "peft_2d"}


def validate_adapter(
    config_path: Path, weights_path: Path, spec: ModelSpec, max_rank: int
) -> AdapterSummary:
    """What the adapter is; InvalidArgument naming the file and tensor otherwise.
    Reads the header and then the weights once (memory-mapped, not loaded)."""
    try:
        config = parse_adapter_config(config_path.read_bytes())
    except InvalidArgument as err:
        raise _in_file(CONFIG_FILE, err) from None
    header = read_header(weights_path)  # names the file itself
    try:
        layout = inspect_adapter(config, header, spec, max_rank)
    except InvalidArgument as err:
        raise _in_file(
            f"{WEIGHTS_FILE} (base model {spec.model_type} {spec.fingerprint[:19]})", err
        ) from None
    problem = None
    with (
        weights_path.open("rb") as handle,
        mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped,
        memoryview(mapped) as view,
    ):
        try:
            check_finite(header, view)
            check_scaled(layout, header, view)
        except InvalidArgument as err:
            # Raised only after the map is closed: the traceback holds views into it.
            problem = _in_file(WEIGHTS_FILE, err)
    if problem is not None:
        raise problem
    return AdapterSummary(
        format=_FORMATS[layout.format],
        rank=layout.rank,
        lora_alpha=layout.lora_alpha,
        use_rslora=layout.use_rslora,
        target_parameters=layout.target_parameters,
        layers=tuple(sorted(layout.layers)),
        dtype=_DTYPES[layout.dtype],
    )


def check_stream_start(
    config: bytes | None, weights_head: bytes, weights_size: int, spec: ModelSpec, max_rank: int
) -> bool:
    """The checks an upload can pass before its weights have arrived: the
    safetensors header (against the declared size) and, when the config is
    complete, the fit to the base model. False while the header is incomplete;
    True once checked, so that a doomed multi-gigabyte upload fails at its
    first megabyte. ``validate_adapter`` still checks everything at the end."""
    if len(weights_head) < PREFIX_BYTES:
        return False
    try:
        length = header_length(weights_head)
        if len(weights_head) < PREFIX_BYTES + length:
            return False
        header = parse_header(weights_head[PREFIX_BYTES : PREFIX_BYTES + length], weights_size)
    except InvalidArgument as err:
        raise _in_file(WEIGHTS_FILE, err) from None
    if config is not None:
        try:
            parsed = parse_adapter_config(config)
        except InvalidArgument as err:
            raise _in_file(CONFIG_FILE, err) from None
        try:
            inspect_adapter(parsed, header, spec, max_rank)
        except InvalidArgument as err:
            raise _in_file(_weights_for(spec), err) from None
    return True


def _weights_for(spec: ModelSpec) -> str:
    return f"{WEIGHTS_FILE} (base model {spec.model_type} {spec.fingerprint[:19]})"


def _in_file(where: str, err: InvalidArgument) -> InvalidArgument:
    return InvalidArgument(f"{where}: {err.message}", err.field)
