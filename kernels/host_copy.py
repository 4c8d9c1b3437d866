"""Copies between page-locked host memory and the GPU made by the GPU's threads, not by a copy
engine ("zero-copy").

With unified addressing, a page-locked host buffer is mapped into the device's address space,
so a kernel can load from it and store to it across the bus. Serving's inputs and outputs go
this way for two reasons:

* **A copy engine queues by stream.** It serves the copies one stream has queued before
  anyone else's. On an H100, a Forward-like step (64 KB in, 8 small matmuls, 64 KB out) took
  12 ms instead of 0.15 beside a 630 MB copy on another stream. A load's slot write is such a
  copy. The same step with its input and output moved by this kernel took 0.16 ms beside it,
  and 0.08 inside a CUDA graph (0.07 alone).
* **A kernel can be captured in a CUDA graph.** The graph then reads its host buffers in
  place when it is replayed, with no copies launched from Python.

It costs nothing in rate: 44–51 GB/s for 2–67 MB on that H100, as a copy engine.

``copy_bytes(dest, source)``: both contiguous, with the same number of bytes, any dtypes.
Each is device memory or page-locked host memory. Without a GPU (Triton's interpreter),
any CPU memory.

``gather_rows(dest, sources)`` and ``scatter_rows(source, dests)``: rows copied from and to
the addresses in a table of one address per row (0: leave that row), which
``row_addresses`` fills. A CUDA graph that captures them reads the table when it is
replayed, so one graph gathers and scatters any set of requests' rows, wherever they lie,
with no launch from Python per request (each costs tens of microseconds).
"""

# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (Triton kernels take untyped pointer and constexpr arguments.)
from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

#: Bytes per program; with 4 warps, 64 bytes per thread as four 16-byte accesses.
BLOCK_BYTES = 8192
NUM_WARPS = 4


@triton.jit
def _copy_bytes_kernel(source_ptr, dest_ptr, nbytes, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < nbytes
    tl.store(dest_ptr + offsets, tl.load(source_ptr + offsets, mask=mask), mask=mask)


def copy_bytes(dest: torch.Tensor, source: torch.Tensor) -> None:
    """dest ← source, byte for byte, by a kernel on the current stream of the GPU involved.

    Raises ValueError when the byte counts differ, a tensor is not contiguous, or, on a GPU, a
    host tensor is not page-locked (the device cannot reach it).
    """
    nbytes = dest.numel() * dest.element_size()
    if source.numel() * source.element_size() != nbytes:
        raise ValueError(
            f"copy of {source.numel() * source.element_size()} bytes into {nbytes} bytes"
        )
    for name, tensor in (("dest", dest), ("source", source)):
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        if (
            torch.cuda.is_available()
            and tensor.device.type == "cpu"
            and nbytes
            and not tensor.is_pinned()
        ):
            raise ValueError(f"{name} is host memory that is not page-locked")
    if nbytes == 0:
        return
    grid = (triton.cdiv(nbytes, BLOCK_BYTES),)
    _copy_bytes_kernel[grid](
        _bytes(source), _bytes(dest), nbytes, BLOCK=BLOCK_BYTES, num_warps=NUM_WARPS
    )


#: Elements per program of ``gather_rows`` and ``scatter_rows``.
ROW_BLOCK = 1024


@triton.jit
def _table_rows_kernel(
    matrix_ptr, table_ptr, row_elements, GATHER: tl.constexpr, BLOCK: tl.constexpr
):
    """Row ``i`` of the matrix ← the row at address table[i] (GATHER), or the other way."""
    row = tl.program_id(0)
    address = tl.load(table_ptr + row)
    if address != 0:
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < row_elements
        far = address.to(tl.pointer_type(matrix_ptr.dtype.element_ty))
        near = matrix_ptr + row.to(tl.int64) * row_elements
        if GATHER:
            tl.store(near + cols, tl.load(far + cols, mask=mask), mask=mask)
        else:
            tl.store(far + cols, tl.load(near + cols, mask=mask), mask=mask)


def gather_rows(dest: torch.Tensor, sources: torch.Tensor) -> None:
    """dest[i] ← the row at address sources[i] (same dtype and width), for every i whose
    address is not 0; those rows keep what they held.

    ``dest``: (R, C) contiguous, device memory. ``sources``: (R,) int64 that the device reads
    when the kernel runs (page-locked on a GPU), each address memory the device reaches at
    that address: unchecked, as ``copy_bytes`` checks its tensors, since a table holds bare
    addresses.
    """
    _table_rows(dest, sources, gather=True)


def scatter_rows(source: torch.Tensor, dests: torch.Tensor) -> None:
    """The row at address dests[i] ← source[i], for every i whose address is not 0
    (``gather_rows`` the other way)."""
    _table_rows(source, dests, gather=False)


def _table_rows(matrix: torch.Tensor, table: torch.Tensor, gather: bool) -> None:
    if matrix.dim() != 2 or not matrix.is_contiguous():
        raise ValueError("rows must be a contiguous matrix")
    if table.dtype != torch.int64 or tuple(table.shape) != (matrix.shape[0],):
        raise ValueError(f"need one int64 address per row: {matrix.shape[0]}")
    rows, columns = int(matrix.shape[0]), int(matrix.shape[1])
    if rows and columns:
        grid = (rows, triton.cdiv(columns, ROW_BLOCK))
        _table_rows_kernel[grid](
            matrix, table, columns, GATHER=gather, BLOCK=ROW_BLOCK, num_warps=NUM_WARPS
        )


def row_addresses(matrices: Sequence[torch.Tensor], table: torch.Tensor) -> int:
    """Writes the addresses of the rows of ``matrices`` (each (n_i, C), contiguous), one after
    the other, into the start of ``table`` (int64) and 0 into the rest of it; returns the
    number of rows. One small torch call per matrix: a launch fills its tables on the
    launch loop's time."""
    at = 0
    row_bytes = matrices[0].shape[1] * matrices[0].element_size() if matrices else 0
    for matrix in matrices:
        if matrix.dim() != 2 or not matrix.is_contiguous():
            raise ValueError("rows must be contiguous matrices")
        if matrix.shape[1] * matrix.element_size() != row_bytes:
            raise ValueError("every matrix needs rows of the same bytes")
        rows = int(matrix.shape[0])
        if at + rows > table.numel():
            raise ValueError(f"{at + rows} rows do not fit a table of {table.numel()}")
        base = matrix.data_ptr()
        torch.arange(base, base + rows * row_bytes, row_bytes, out=table[at : at + rows])
        at += rows
    table[at:].zero_()
    return at


def gather_rows_reference(dest: torch.Tensor, parts: Sequence[torch.Tensor]) -> None:
    """What ``gather_rows`` computes for a table that ``row_addresses(parts, ...)`` filled."""
    rows = sum(int(p.shape[0]) for p in parts)
    if rows:
        dest[:rows].copy_(torch.cat([p.to(dest.device) for p in parts]))


def scatter_rows_reference(source: torch.Tensor, outputs: Sequence[torch.Tensor]) -> None:
    """What ``scatter_rows`` computes for a table that ``row_addresses(outputs, ...)`` filled."""
    at = 0
    for output in outputs:
        rows = int(output.shape[0])
        output.copy_(source[at : at + rows])
        at += rows


def copy_bytes_reference(dest: torch.Tensor, source: torch.Tensor) -> None:
    """What ``copy_bytes`` computes, in torch (a copy engine's copy on a GPU)."""
    _bytes(dest).copy_(_bytes(source))


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)
