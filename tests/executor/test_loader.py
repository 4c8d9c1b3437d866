"""Loader threads: their torch thread count and CPU priority are theirs alone (serving's
threads, and threads started later, keep the process's)."""

from __future__ import annotations

import os
import sys
import threading

import pytest
import torch

from executor_service.loader import Loader


def _priority() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def _in_new_thread() -> tuple[int, int]:
    seen: list[tuple[int, int]] = []
    thread = threading.Thread(target=lambda: seen.append((torch.get_num_threads(), _priority())))
    thread.start()
    thread.join()
    return seen[0]


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread nice values are Linux's")
def test_loader_threads_limit_themselves_only() -> None:
    process_threads = torch.get_num_threads()
    before = _in_new_thread()
    loader = Loader(torch_threads=1, nice=5)
    try:
        threads, priority = loader.run(lambda: (torch.get_num_threads(), _priority()))
        # Work on the loader thread runs as limited (a pack, for instance).
        packed = loader.run(lambda: torch.ones(1 << 20).mul(2).sum().item())
    finally:
        loader.close()
    assert threads == 1
    assert priority == min(19, before[1] + 5)
    assert packed == 2 * (1 << 20)
    assert torch.get_num_threads() == process_threads
    assert _in_new_thread() == before  # not what the loader set
