"""``copy_bytes``, ``gather_rows`` and ``scatter_rows`` against torch's copy: every byte once,
whatever the size and dtypes; on a GPU between page-locked host memory and the device both
ways, and inside a CUDA graph that reads and writes its host buffers when it is replayed."""

from __future__ import annotations

import pytest
import torch

from kernels.host_copy import (
    BLOCK_BYTES,
    copy_bytes,
    copy_bytes_reference,
    gather_rows,
    gather_rows_reference,
    row_addresses,
    scatter_rows,
    scatter_rows_reference,
)

from .conftest import DEVICE, gpu_only


def _random_bytes(nbytes: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)


@pytest.mark.parametrize(
    "nbytes", [1, 15, 16, BLOCK_BYTES - 1, BLOCK_BYTES, BLOCK_BYTES + 1, 3 * BLOCK_BYTES + 17]
)
def test_copies_every_byte_and_nothing_past_the_end(nbytes: int) -> None:
    source = _random_bytes(nbytes, seed=nbytes).to(DEVICE)
    backing = torch.full((nbytes + 64,), 0xA5, dtype=torch.uint8, device=DEVICE)
    copy_bytes(backing[:nbytes], source)
    expected = torch.full_like(backing, 0xA5)
    copy_bytes_reference(expected[:nbytes], source)
    assert torch.equal(backing, expected)
    assert torch.equal(backing[:nbytes], source)


def test_reinterprets_dtypes_byte_for_byte() -> None:
    source = torch.randn(6, 10, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    dest = torch.empty(30, dtype=torch.int32, device=DEVICE)
    copy_bytes(dest, source.to(DEVICE))
    assert torch.equal(dest.cpu().view(torch.bfloat16).reshape(6, 10), source)


def test_refuses_mismatched_or_strided_tensors() -> None:
    with pytest.raises(ValueError, match="copy of 12 bytes into 16 bytes"):
        copy_bytes(torch.empty(4, device=DEVICE), torch.empty(3, device=DEVICE))
    strided = torch.empty(4, 4, device=DEVICE)[:, :2]
    with pytest.raises(ValueError, match="source must be contiguous"):
        copy_bytes(torch.empty(8, device=DEVICE), strided)


def _addresses(rows: int) -> torch.Tensor:
    table = torch.full((rows,), -1, dtype=torch.int64)
    return table.pin_memory() if DEVICE == "cuda" else table


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_gather_from_and_scatter_to_the_table_s_addresses(dtype: torch.dtype) -> None:
    """Requests' rows (uneven counts, separate buffers, width past one program's block)
    gathered in order into a padded matrix and scattered back to other buffers: rows past
    the table's addresses are left alone both ways."""
    columns, padded = 1500, 16
    generator = torch.Generator().manual_seed(8)
    parts = [torch.randn(n, columns, generator=generator).to(dtype) for n in (3, 1, 7)]
    parts = [p.pin_memory() if DEVICE == "cuda" else p for p in parts]
    table = _addresses(padded)
    assert row_addresses(parts, table) == 11
    assert bool((table[11:] == 0).all()) and table[0] == parts[0].data_ptr()
    dest = torch.full((padded, columns), 5.0, dtype=dtype, device=DEVICE)
    expected = dest.clone()
    gather_rows(dest, table)
    gather_rows_reference(expected, parts)
    assert torch.equal(dest, expected), "rows misplaced, or a padding row written"
    outputs = [torch.zeros_like(p) for p in parts]
    outputs = [o.pin_memory() if DEVICE == "cuda" else o for o in outputs]
    assert row_addresses(outputs, table) == 11
    source = (dest * 2).contiguous()
    scatter_rows(source, table)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    wanted = [torch.zeros_like(p) for p in parts]
    scatter_rows_reference(source.cpu(), wanted)
    assert all(torch.equal(o, w) for o, w in zip(outputs, wanted, strict=True))
    assert all(torch.equal(w, p * 2) for w, p in zip(wanted, parts, strict=True))


def test_row_addresses_refuses_rows_it_cannot_describe() -> None:
    table = _addresses(4)
    with pytest.raises(ValueError, match="same bytes"):
        row_addresses([torch.zeros(1, 4), torch.zeros(1, 8)], table)
    with pytest.raises(ValueError, match="5 rows do not fit a table of 4"):
        row_addresses([torch.zeros(5, 4)], table)
    with pytest.raises(ValueError, match="contiguous"):
        row_addresses([torch.zeros(4, 8)[:, :4]], table)
    assert row_addresses([], table) == 0 and bool((table == 0).all())


@gpu_only
def test_moves_bytes_between_page_locked_host_memory_and_the_gpu() -> None:
    nbytes = 5 * BLOCK_BYTES + 3
    host = _random_bytes(nbytes, seed=2).pin_memory()
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    copy_bytes(device, host)
    back = torch.zeros(nbytes, dtype=torch.uint8).pin_memory()
    copy_bytes(back, device)
    torch.cuda.synchronize()
    assert torch.equal(device.cpu(), host)
    assert torch.equal(back, host)


@gpu_only
def test_refuses_pageable_host_memory_on_a_gpu() -> None:
    with pytest.raises(ValueError, match="source is host memory that is not page-locked"):
        copy_bytes(
            torch.empty(16, dtype=torch.uint8, device="cuda"), torch.empty(16, dtype=torch.uint8)
        )


@gpu_only
def test_a_captured_graph_reads_and_writes_its_host_buffers_when_replayed() -> None:
    host_in = torch.zeros(4096, dtype=torch.float32).pin_memory()
    host_out = torch.zeros(4096, dtype=torch.float32).pin_memory()
    scratch = torch.empty(4096, dtype=torch.float32, device="cuda")

    def body() -> None:
        copy_bytes(scratch, host_in)
        scratch.mul_(2)
        copy_bytes(host_out, scratch)

    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    for seed in (3, 4):
        values = torch.randn(4096, generator=torch.Generator().manual_seed(seed))
        host_in.copy_(values)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(host_out, values * 2)
