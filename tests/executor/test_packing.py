"""Packing is exact wherever it runs.

CPU: a 3D adapter packs to its definition bit for bit — A_e = A.reshape(E, r, in)[e] cast, and
B_e = B[:, e::E] times the scaling in float32, rounded once to the serving dtype (gpt_oss's
gate/up rows de-interleaved) — whatever the band size of B's blocked gather; weights still
arriving are read only where they have arrived; NaN/Inf and overflow are refused naming what.

GPU (marked ``gpu``): a CUDA pack equals the CPU pack bit for bit for 3D, 2D and gpt_oss
adapters in every serving dtype, through staging buffers smaller than a tensor, from arriving
weights and from a file whose tensors lie off their alignment; it refuses the same adapters
with the same messages; and it keeps about one layer on the device.

Self-contained (synthetic adapters, no transformers or PEFT), so that it also runs where only
torch is installed: ``pytest --noconftest -m gpu tests/executor/test_packing.py``.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load, save

from executor_service import pack_device
from executor_service.host_pool import HostPool
from executor_service.pack_device import CpuPackDevice, coalesce
from executor_service.packer import PackedAdapter, pack_adapter
from executor_service.page_cache_dma import MappedFile, RegisterError, Window
from executor_service.synthetic import (
    SyntheticAdapter,
    SyntheticBase,
    write_adapter,
    write_base_checkpoint,
)
from moelora.client.errors import InvalidArgument
from moelora.client.model_spec import ModelSpec
from moelora.client.safetensors_header import parse_bytes
from shared.adapter_format import AdapterFormat, Projection, inspect_adapter

CUDA = pytest.param(
    "cuda",
    marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    ],
)
DEVICES = ["cpu", CUDA]
SERVING = [torch.float32, torch.bfloat16, torch.float16]
MAX_RANK = 16
NAMES = ("a13", "b13", "a2", "b2")


@dataclass(frozen=True)
class Case:
    model_type: str
    stored: torch.dtype
    adapter: SyntheticAdapter = field(default_factory=SyntheticAdapter)

    @property
    def id(self) -> str:
        kind = "2d" if self.adapter.format is AdapterFormat.PER_EXPERT else "3d"
        return f"{self.model_type}-{kind}-{str(self.stored).removeprefix('torch.')}"


CASES_3D = [
    Case("qwen3_moe", torch.bfloat16, SyntheticAdapter(rank=8, alpha=12.0)),
    Case(
        "qwen3_moe",
        torch.float32,
        SyntheticAdapter(rank=8, use_rslora=True, rank_pattern={r".*\.down_proj": 4}),
    ),
    Case("gpt_oss", torch.float16, SyntheticAdapter(rank=6, alpha=3.0)),
    Case("olmoe", torch.bfloat16, SyntheticAdapter(targets=("gate_up_proj",))),
]
CASES_2D = [
    Case("mixtral", torch.float32, SyntheticAdapter(rank=4, format=AdapterFormat.PER_EXPERT)),
    Case(
        "qwen3_moe",
        torch.bfloat16,
        SyntheticAdapter(rank=3, alpha=5.0, format=AdapterFormat.PER_EXPERT),
    ),
]


@dataclass(frozen=True)
class Written:
    spec: ModelSpec
    config: dict[str, Any]
    weights: Path


def write(root: Path, case: Case, base: SyntheticBase | None = None) -> Written:
    base = base or SyntheticBase(case.model_type, num_experts=4)
    spec = write_base_checkpoint(root / "base", base, dtype=torch.float32)
    folder = write_adapter(root / "adapter", spec, case.adapter, dtype=case.stored, seed=7)
    config = json.loads((folder / "adapter_config.json").read_text())
    return Written(spec, config, folder / "adapter_model.safetensors")


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers: equal bits, not equal values (-0.0, NaN payloads)."""
    return tensor.contiguous().view({2: torch.int16, 4: torch.int32}[tensor.element_size()])


def assert_same_bits(got: PackedAdapter, expected: PackedAdapter) -> None:
    assert (got.rank, got.nbytes, set(got.layers)) == (
        expected.rank,
        expected.nbytes,
        set(expected.layers),
    )
    for index, layer in expected.layers.items():
        for name in NAMES:
            want, have = getattr(layer, name), getattr(got.layers[index], name)
            if want is None:
                assert have is None, (index, name)
                continue
            assert have.device.type == "cpu" and have.dtype == want.dtype, (index, name)
            assert have.shape == want.shape, (index, name)
            assert torch.equal(bits(have), bits(want)), (index, name)


# -- CPU: the definition ---------------------------------------------------------------------


def definition(written: Written, dtype: torch.dtype) -> dict[tuple[int, str], torch.Tensor]:
    """A 3D adapter's packed tensors computed the plain way, by (layer, name)."""
    raw = written.weights.read_bytes()
    layout = inspect_adapter(written.config, parse_bytes(raw), written.spec, MAX_RANK)
    stored = load(raw)
    e = written.spec.num_experts
    expected = {}
    for index, layer in layout.layers.items():
        for pair in layer.pairs:
            a, b = stored[pair.a_key], stored[pair.b_key]
            factor = b.reshape(b.shape[0], pair.rank, e).permute(2, 0, 1)
            suffix = "2" if pair.projection is Projection.DOWN else "13"
            if suffix == "13" and written.spec.type.gate_up_interleaved:
                factor = torch.cat((factor[:, 0::2], factor[:, 1::2]), dim=1)
            expected[index, f"a{suffix}"] = a.reshape(e, pair.rank, -1).to(dtype)
            expected[index, f"b{suffix}"] = (factor.float() * pair.scaling).to(dtype)
    return expected


@pytest.mark.parametrize("dtype", SERVING, ids=str)
@pytest.mark.parametrize("case", CASES_3D, ids=lambda c: c.id)
def test_3d_packing_is_the_definition_whatever_the_band(
    case: Case, dtype: torch.dtype, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    written = write(tmp_path, case)
    expected = definition(written, dtype)
    row = 4 * case.adapter.rank * written.spec.num_experts  # bytes of one B row at most
    for band in (1, 3 * row + 1, pack_device.CPU_BAND_BYTES):  # one row, three, the default
        monkeypatch.setattr(CpuPackDevice, "band_bytes", band)
        packed = pack_adapter(written.config, written.weights, written.spec, MAX_RANK, dtype)
        got = {
            (index, name): getattr(layer, name)
            for index, layer in packed.layers.items()
            for name in NAMES
            if getattr(layer, name) is not None
        }
        assert got.keys() == expected.keys()
        for key, want in expected.items():
            assert torch.equal(bits(got[key]), bits(want)), (band, key)


def test_coalesce_joins_tensors_that_lie_together() -> None:
    spans = [(300, 400, "c"), (0, 100, "a"), (100, 250, "b"), (10_000, 10_008, "d")]
    assert coalesce(spans, gap=64) == [
        [(0, 100, "a"), (100, 250, "b"), (300, 400, "c")],
        [(10_000, 10_008, "d")],
    ]
    assert coalesce(spans, gap=0) == [
        [(0, 100, "a"), (100, 250, "b")],
        [(300, 400, "c")],
        [(10_000, 10_008, "d")],
    ]


# -- both devices ------------------------------------------------------------------------------


class Trickle:
    """Weights still arriving: the buffer holds 0xFF bytes (NaN in every float type) until a
    range is waited for, which then arrives."""

    def __init__(self, raw: bytes) -> None:
        self._raw = raw
        self._buffer: bytearray | mmap.mmap = bytearray(b"\xff" * len(raw))
        self.waits: list[tuple[int, int]] = []

    def view(self) -> memoryview:
        return memoryview(self._buffer)

    def wait(self, begin: int, end: int) -> None:
        self._buffer[begin:end] = self._raw[begin:end]
        self.waits.append((begin, end))

    @property
    def path(self) -> Path | None:
        return None  # in memory only


class FileTrickle(Trickle):
    """Weights arriving into a file, as a download writes them: the file holds 0xFF bytes until
    a range is waited for, which is then written to it. A CUDA pack reads the file itself
    (pread), so a read ahead of its wait would get NaN."""

    def __init__(self, raw: bytes, path: Path) -> None:
        super().__init__(raw)
        path.write_bytes(b"\xff" * len(raw))
        self._path = path
        fd = os.open(path, os.O_RDWR)
        try:
            self._buffer = mmap.mmap(fd, len(raw))  # shared, as a download's: the file's pages
        finally:
            os.close(fd)

    @property
    def path(self) -> Path | None:
        return self._path


@pytest.mark.parametrize("into", ["memory", "file", "file, staged"])
@pytest.mark.parametrize("device", DEVICES)
def test_arriving_weights_are_read_where_they_arrived(
    device: str, into: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From a file a CUDA pack copies the page cache (registered windows of two pages) or
    stages it; either way a range is read only after its wait."""
    written = write(tmp_path, CASES_3D[0], SyntheticBase("qwen3_moe", num_layers=3))
    monkeypatch.setattr(pack_device, "STAGING_BYTES", 4096)  # several chunks per tensor
    monkeypatch.setattr(pack_device, "WINDOW_BYTES", 2 * mmap.PAGESIZE)  # several windows
    expected = pack_adapter(written.config, written.weights, written.spec, MAX_RANK, torch.bfloat16)
    raw = written.weights.read_bytes()
    arriving = Trickle(raw) if into == "memory" else FileTrickle(raw, tmp_path / "arriving")
    got = pack_adapter(
        written.config,
        arriving,
        written.spec,
        MAX_RANK,
        torch.bfloat16,
        device=device,
        page_cache_dma=into != "file, staged",
    )
    assert_same_bits(got, expected)
    ends = [end for _, end in arriving.waits]
    assert ends == sorted(ends), "the pack reads the file front to back"


def poisoned(written: Written, key_part: str, value: float) -> bytes:
    tensors = load(written.weights.read_bytes())
    key = next(k for k in tensors if key_part in k)
    tensors[key].view(-1)[-1] = value
    return save(tensors)


@pytest.mark.parametrize("device", DEVICES)
def test_nan_is_refused_naming_the_tensor(device: str, tmp_path: Path) -> None:
    written = write(tmp_path, CASES_3D[0])
    last = written.spec.moe_layers[-1]
    weights = poisoned(written, f"layers.{last}.mlp.experts.lora_B", float("nan"))
    key = f"layers.{last}.mlp.experts.lora_B.weight contains NaN or Inf"
    for only in (None, frozenset(written.spec.moe_layers[:1])):  # packed, or only checked
        with pytest.raises(InvalidArgument, match=key):
            pack_adapter(
                written.config, weights, written.spec, MAX_RANK, torch.bfloat16, only, device=device
            )


@pytest.mark.parametrize("device", DEVICES)
def test_overflow_once_scaled_is_refused(device: str, tmp_path: Path) -> None:
    case = Case("olmoe", torch.float32, SyntheticAdapter(alpha=16.0, rank=8))
    written = write(tmp_path, case)
    weights = poisoned(written, "layers.1.mlp.experts.lora_B", 40000.0)  # × 2: not a float16
    # float32 holds it: the poisoned value comes out scaled (alpha/r = 2), not refused.
    packed = pack_adapter(written.config, weights, written.spec, 8, torch.float32, device=device)
    assert packed.layers[1].b2 is not None
    assert float(packed.layers[1].b2.abs().max()) == 80000.0
    with pytest.raises(InvalidArgument, match="adapter LoRA b2 overflows float16 once scaled"):
        pack_adapter(written.config, weights, written.spec, 8, torch.float16, device=device)


# -- GPU: the CPU's bits ------------------------------------------------------------------------

gpu = pytest.mark.parametrize("device", [CUDA])


@gpu
@pytest.mark.parametrize("dtype", SERVING, ids=str)
@pytest.mark.parametrize("case", CASES_3D + CASES_2D, ids=lambda c: c.id)
def test_cuda_pack_is_the_cpu_pack(
    device: str, case: Case, dtype: torch.dtype, tmp_path: Path
) -> None:
    written = write(tmp_path, case)
    args = (written.config, written.weights, written.spec, MAX_RANK, dtype)
    got = pack_adapter(*args, device=device)
    assert_same_bits(got, pack_adapter(*args))
    assert all(
        t.is_pinned()
        for layer in got.layers.values()
        for t in vars(layer).values()
        if t is not None
    )


@pytest.mark.parametrize("device", DEVICES)
def test_unaligned_tensors(device: str, tmp_path: Path) -> None:
    """safetensors' own writer pads its header to 8 bytes; another may not, leaving every
    tensor two bytes off a float32 boundary."""
    written = write(tmp_path, Case("qwen3_moe", torch.float32))
    raw = unaligned(load(written.weights.read_bytes()))
    assert parse_bytes(raw).data_start % 4 == 2
    args = (written.config, raw, written.spec, MAX_RANK, torch.bfloat16)
    aligned = (written.config, written.weights, written.spec, MAX_RANK, torch.bfloat16)
    assert_same_bits(pack_adapter(*args, device=device), pack_adapter(*aligned))


def unaligned(tensors: dict[str, torch.Tensor]) -> bytes:
    """A float32 safetensors file whose data section starts 2 bytes past a multiple of 4."""
    header: dict[str, Any] = {}
    data = bytearray()
    for key in sorted(tensors):
        raw = tensors[key].contiguous().numpy().tobytes()
        header[key] = {
            "dtype": "F32",
            "shape": list(tensors[key].shape),
            "data_offsets": [len(data), len(data) + len(raw)],
        }
        data += raw
    text = json.dumps(header).encode()
    text += b" " * (-(len(text) + 2) % 4)
    return struct.pack("<Q", len(text)) + text + bytes(data)


@gpu
def test_cuda_pack_keeps_about_one_layer_on_the_device(device: str, tmp_path: Path) -> None:
    base = SyntheticBase("qwen3_moe", hidden_size=256, moe_intermediate_size=128, num_layers=6)
    written = write(tmp_path, Case("qwen3_moe", torch.float32), base)
    layer_bytes = written.weights.stat().st_size / len(written.spec.moe_layers)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    args = (written.config, written.weights, written.spec, MAX_RANK, torch.bfloat16)
    pack_adapter(*args, device=device)
    # A layer's stored bytes, its packed tensors (half: bfloat16), B's scratch and the
    # float32 scaling of B (each at most the layer's bytes): under 3 layers, not 6.
    assert torch.cuda.max_memory_allocated() - before < 3 * layer_bytes
    assert torch.cuda.memory_allocated() == before


class FailingPages(MappedFile):
    """A mapped file whose ``fail_at``-th registration is declined, as a driver may."""

    def __init__(self, path: Path, fail_at: int) -> None:
        super().__init__(path, torch.cuda.current_device())
        self.registered = 0
        self._fail_at = fail_at

    def register(self, begin: int, end: int) -> Window:
        self.registered += 1
        if self.registered == self._fail_at:
            raise RegisterError("declined by the test")
        return super().register(begin, end)


@gpu
@pytest.mark.parametrize("fail_at", [0, 1, 3], ids=["none", "first", "third"])
def test_the_page_cache_is_copied_until_a_registration_is_declined(
    device: str,
    fail_at: int,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A CUDA pack copies a file's registered pages, window by window; once the driver
    declines a window (``fail_at``: the n-th, 0 never), that window and the rest go through
    the staging buffers. Either way the device holds the file's bytes."""
    written = write(tmp_path, CASES_3D[0], SyntheticBase("qwen3_moe", num_layers=3))
    monkeypatch.setattr(pack_device, "WINDOW_BYTES", 4 * mmap.PAGESIZE)
    data, wait = pack_device.open_weights(written.weights)
    header = parse_bytes(data)
    keys = sorted(header.tensors, key=lambda key: header.tensors[key].begin)
    pages = FailingPages(written.weights, fail_at)
    with pack_device.file_reader(written.weights) as read:
        try:
            stored = pack_device.StoredTensors(header, data, wait, read, pages)
            cuda = torch.device(device)
            work = pack_device.pack_device(cuda, stored, torch.float32, HostPool(0, cuda))
            with work.running():
                work.begin_layer(keys)  # the whole file as one layer
                got = {key: work.tensor(key).cpu() for key in keys}
        finally:
            pages.close()
    for key in keys:
        assert torch.equal(got[key], stored.host(key)), key
    declined = any(
        record.getMessage() == "page_cache_dma_declined"
        and getattr(record, "moelora_fields", {}).get("error") == "declined by the test"
        for record in caplog.records
    )
    assert declined == bool(fail_at)
    if fail_at:
        assert pages.registered == fail_at, "a declined driver is not asked again"
    else:
        assert pages.registered > 3, "the pack registered window by window"


def test_the_file_reader_reads_ranges_and_names_a_file_cut_short(tmp_path: Path) -> None:
    """What a CUDA pack stages a file through (pread): any range, in any order; a file
    shorter than its header says fails naming the file, not with stale staging bytes."""
    data = bytes(range(256)) * 64
    path = tmp_path / "weights"
    path.write_bytes(data)
    with pack_device.file_reader(path) as read:
        assert read is not None
        into = bytearray(1000)
        read(7000, memoryview(into))
        assert bytes(into) == data[7000:8000]
        read(3, memoryview(into)[:10])
        assert bytes(into[:10]) == data[3:13]
        with pytest.raises(EOFError, match="ends at byte"):
            read(len(data) - 5, memoryview(bytearray(10)))
    with pack_device.file_reader(None) as nothing:
        assert nothing is None
