"""The executor's process-wide settings: the GIL switch interval, and page-locked memory
through cudaHostRegister unless the operator configured page-locked memory already."""

from __future__ import annotations

import resource
import sys
from collections.abc import Iterator

import pytest

from executor_service.config import ExecutorSettings
from executor_service.process import PINNED_ALLOCATOR, configure_process


@pytest.fixture
def interval() -> Iterator[None]:
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        (None, PINNED_ALLOCATOR),
        ("expandable_segments:True", f"expandable_segments:True,{PINNED_ALLOCATOR}"),
        ("pinned_use_cuda_host_register:False", "pinned_use_cuda_host_register:False"),
    ],
    ids=["unset", "other-settings-kept", "operator-pinned-wins"],
)
def test_page_locked_memory_defaults_to_host_register(
    interval: None, given: str | None, expected: str
) -> None:
    environ = {} if given is None else {"PYTORCH_CUDA_ALLOC_CONF": given}
    configure_process(ExecutorSettings.model_validate({"gil_switch_interval_us": 300}), environ)
    assert environ == {"PYTORCH_CUDA_ALLOC_CONF": expected}
    assert sys.getswitchinterval() == pytest.approx(300e-6)


def test_the_open_files_limit_is_lifted_to_the_hard_one(interval: None) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowered = min(soft, 256)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowered, hard))
    try:
        configure_process(ExecutorSettings.model_validate({}), {})
        raised, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        assert raised == (hard if hard != resource.RLIM_INFINITY else 1 << 20)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
