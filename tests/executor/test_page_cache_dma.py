"""A file's page-cache pages lent to a CUDA device (executor_service/page_cache_dma.py).

CPU: windows view exactly the bytes asked for and refuse others; nothing is mapped for a CPU
device. GPU (marked ``gpu``): a mapping refuses ranges outside its file; registered windows of
a file copy its bytes to the device from any offset; a second registration of the same pages is
declined with a RegisterError that leaves torch's next launch on the thread unharmed (the
driver API keeps no sticky error).
"""

from __future__ import annotations

import ctypes
import mmap
from pathlib import Path

import pytest
import torch

from executor_service.page_cache_dma import (
    MappedFile,
    RegisterError,
    Window,
    open_for_dma,
    registration_declined,
)

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture
def registering() -> torch.device:
    """The GPU, where its platform registers file mappings (the probe says why not, e.g. a
    sticky CUDA_ERROR_INVALID_ADDRESS_SPACE under gVisor); those tests skip elsewhere."""
    device = torch.device("cuda")
    if (reason := registration_declined(device)) is not None:
        pytest.skip(f"this platform registers no file mappings: {reason}")
    return device


PAGE = mmap.PAGESIZE


def a_file(tmp_path: Path, size: int) -> tuple[Path, bytes]:
    data = bytes((index * 7 + index // 251) % 256 for index in range(size))
    path = tmp_path / "weights"
    path.write_bytes(data)
    return path, data


def test_a_window_views_only_its_bytes() -> None:
    memory = bytearray(range(256)) * 32  # 8 KiB standing in for two registered pages
    address = ctypes.addressof(ctypes.c_char.from_buffer(memory))
    window = Window(address, offset=3 * PAGE, size=len(memory))
    assert bytes(window.tensor(3 * PAGE + 5, 3 * PAGE + 9).tolist()) == memory[5:9]
    assert window.tensor(3 * PAGE, 3 * PAGE).numel() == 0
    for begin, end in ((3 * PAGE - 1, 3 * PAGE + 1), (3 * PAGE, 3 * PAGE + len(memory) + 1)):
        with pytest.raises(ValueError, match="outside the window"):
            window.tensor(begin, end)


def test_nothing_is_mapped_for_a_cpu_device_or_an_empty_file_or_none(tmp_path: Path) -> None:
    path, _ = a_file(tmp_path, 100)
    with open_for_dma(path, torch.device("cpu")) as pages:
        assert pages is None
    with open_for_dma(None, torch.device("cuda")) as pages:
        assert pages is None
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    with open_for_dma(empty, torch.device("cuda")) as pages:
        assert pages is None  # nothing to copy: not mapped (a zero-length map is an error)


@pytest.mark.gpu
@needs_gpu
def test_a_mapping_refuses_ranges_outside_the_file(tmp_path: Path) -> None:
    path, _ = a_file(tmp_path, 3 * PAGE + 10)
    mapped = MappedFile(path, ordinal=0)
    try:
        assert mapped.size == 3 * PAGE + 10
        for begin, end in ((0, 0), (5, 3 * PAGE + 11), (-1, 4)):
            with pytest.raises(ValueError, match="-byte file"):
                mapped.register(begin, end)
    finally:
        mapped.close()


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("span", [(0, 3 * PAGE + 10), (PAGE - 3, 2 * PAGE + 5), (7, 8)])
def test_registered_pages_copy_to_the_device(
    span: tuple[int, int], tmp_path: Path, registering: torch.device
) -> None:
    device = registering
    path, data = a_file(tmp_path, 3 * PAGE + 10)
    begin, end = span
    with open_for_dma(path, device) as pages:
        assert pages is not None
        window = pages.register(begin, end)
        assert window.offset % PAGE == 0 and window.size % PAGE == 0
        assert window.offset <= begin and end <= window.offset + window.size
        out = torch.empty(end - begin, dtype=torch.uint8, device=device)
        out.copy_(window.tensor(begin, end), non_blocking=True)
        torch.cuda.synchronize()
        pages.release(window)
    assert bytes(out.cpu().tolist()) == data[begin:end]


@pytest.mark.gpu
@needs_gpu
def test_a_declined_registration_leaves_the_thread_launching(
    tmp_path: Path, registering: torch.device
) -> None:
    """Pages already registered are declined (the pack's windows never share a page); the
    error names the driver's reason, and torch launches on this thread as before."""
    device = registering
    path, _ = a_file(tmp_path, 3 * PAGE)
    with open_for_dma(path, device) as pages:
        assert pages is not None
        held = pages.register(0, 2 * PAGE)
        with pytest.raises(RegisterError, match="ALREADY_REGISTERED"):
            pages.register(PAGE, 3 * PAGE)
        assert torch.ones(4, device=device).add_(1).sum().item() == 8.0  # no sticky error
        pages.release(held)
        pages.release(pages.register(PAGE, 3 * PAGE))  # its pages are free again
        pages.register(0, PAGE)  # left registered: closing releases it


@pytest.mark.gpu
@needs_gpu
def test_a_platform_that_registers_no_mapping_costs_the_process_nothing(tmp_path: Path) -> None:
    """Whatever the platform answers, asking leaves this process's context working: where the
    probe declines, nothing is mapped (the packer stages the bytes); where it agrees, a window
    registers and releases."""
    device = torch.device("cuda")
    path, _ = a_file(tmp_path, 2 * PAGE)
    with open_for_dma(path, device) as pages:
        assert (pages is None) == (registration_declined(device) is not None)
        if pages is not None:
            pages.release(pages.register(0, PAGE))
    assert torch.ones(4, device=device).add_(1).sum().item() == 8.0
