"""The host cache's memory pool: ranges of slabs handed out, recycled once their tensors are
gone (after the copies reading them on a GPU), fresh memory where the slabs have no room."""

from __future__ import annotations

import gc
import itertools
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from executor_service.host_pool import ALIGN_BYTES, HostPool, _Slab
from executor_service.packer import pack_adapter
from executor_service.synthetic import SyntheticBase
from tests.executor.test_packing import CASES_3D, assert_same_bits, write

CPU = torch.device("cpu")
MIB = 1 << 20


def _within(pool: HostPool, tensor: torch.Tensor) -> bool:
    """Whether the tensor's memory lies in one of the pool's slabs."""
    at = tensor.data_ptr()
    return any(s.address <= at < s.address + s.size for s in pool._slabs)


def test_a_range_is_recycled_once_its_last_view_is_gone() -> None:
    pool = HostPool(8 * MIB, CPU)
    first = pool.empty((256, 1024), torch.float32)  # 1 MiB
    assert _within(pool, first) and pool.used_bytes == MIB
    address = first.data_ptr()
    view = first[3:5]
    del first
    gc.collect()
    assert pool.used_bytes == MIB  # the view still holds it
    del view
    again = pool.empty((MIB // 2,), torch.bfloat16)
    assert again.data_ptr() == address
    assert pool.used_bytes == MIB and pool.reserved_bytes == 8 * MIB


def test_live_tensors_never_share_bytes() -> None:
    pool = HostPool(4 * MIB, CPU)
    sizes = [5000, ALIGN_BYTES, 1, 3 * ALIGN_BYTES + 7, 100_000]
    tensors = [pool.empty((n,), torch.uint8) for n in sizes]
    for value, tensor in enumerate(tensors):
        tensor.fill_(value)
    for value, tensor in enumerate(tensors):
        assert bool((tensor == value).all()), value
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel()) for t in tensors)
    assert all(end <= start for (_, end), (start, _) in itertools.pairwise(spans))


def test_neighbours_freed_merge_into_one_range() -> None:
    pool = HostPool(4 * MIB, CPU)
    parts = [pool.empty((MIB,), torch.uint8) for _ in range(4)]
    base = parts[0].data_ptr()
    del parts[1:3]  # the middle two
    whole = pool.empty((2 * MIB,), torch.uint8)
    assert whole.data_ptr() == base + MIB


def test_what_the_slabs_cannot_hold_is_fresh_memory() -> None:
    fresh: list[int] = []
    pool = HostPool(2 * MIB, CPU, on_fresh=fresh.append)
    held = pool.empty((2 * MIB,), torch.uint8)
    over = pool.empty((MIB,), torch.uint8)  # the capacity is taken
    too_big = HostPool(MIB, CPU, on_fresh=fresh.append).empty((3 * MIB,), torch.uint8)
    assert _within(pool, held) and not _within(pool, over)
    assert fresh == [MIB, 3 * MIB]
    over.fill_(7)
    too_big.fill_(9)
    assert int(over.sum()) == 7 * MIB and held.numel() == 2 * MIB


def test_a_pool_of_no_capacity_gives_fresh_memory() -> None:
    pool = HostPool(0, CPU)
    tensor = pool.empty((4, 4), torch.float32)
    assert pool.reserved_bytes == 0 and tensor.shape == (4, 4)


def test_reserve_takes_every_slab_at_once() -> None:
    pool = HostPool(3 * MIB, CPU, reserve=True)
    assert pool.slab_bytes == 4 * MIB and pool.reserved_bytes == 4 * MIB
    lazy = HostPool(3 * MIB, CPU)
    assert lazy.reserved_bytes == 0
    lazy.empty((1,), torch.uint8)
    assert lazy.reserved_bytes == 4 * MIB


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 6)), max_size=40))
def test_a_slab_keeps_its_free_ranges_sorted_merged_and_whole(
    steps: list[tuple[bool, int]],
) -> None:
    """Against a byte map: every range taken is free there, and what stays free is exactly
    the free list, sorted, with no two ranges touching."""
    size = 16
    slab = _Slab(0, size, None, [(0, size)])
    free = [True] * size
    held: list[tuple[int, int]] = []
    for take, length in steps:
        if take or not held:
            offset = slab.take(length)
            if offset is None:
                assert not any(all(free[i : i + length]) for i in range(size - length + 1))
                continue
            assert all(free[offset : offset + length])
            free[offset : offset + length] = [False] * length
            held.append((offset, length))
        else:
            offset, length = held.pop(length % len(held))
            slab.give(offset, length)
            free[offset : offset + length] = [True] * length
        listed = [False] * size
        for at, length in slab.free:
            listed[at : at + length] = [True] * length
        assert listed == free
        assert all(a + n < b for (a, n), (b, _) in itertools.pairwise(slab.free))


def test_a_pack_into_the_pool_reuses_the_last_packs_memory(tmp_path: Path) -> None:
    written = write(tmp_path, CASES_3D[0], SyntheticBase("qwen3_moe", num_layers=3))
    fresh: list[int] = []
    pool = HostPool(64 * MIB, CPU, on_fresh=fresh.append)
    args = (written.config, written.weights, written.spec, 8, torch.bfloat16)
    first = pack_adapter(*args, memory=pool)
    assert_same_bits(first, pack_adapter(*args))  # the pool changes where, not what
    used = pool.used_bytes
    addresses = sorted(
        t.data_ptr()
        for layer in first.layers.values()
        for t in vars(layer).values()
        if t is not None
    )
    del first
    gc.collect()
    assert pool.used_bytes == 0
    second = pack_adapter(*args, memory=pool)
    assert pool.used_bytes == used and not fresh
    assert addresses == sorted(
        t.data_ptr()
        for layer in second.layers.values()
        for t in vars(layer).values()
        if t is not None
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_range_is_not_reused_before_the_copy_reading_it_finished() -> None:
    """A copy from a pooled tensor is queued behind a long GPU sleep on the reader stream;
    the tensor is dropped and its range handed out again and overwritten at once. The copy
    must still deliver the old bytes: the new owner waited for it."""
    device = torch.device("cuda")
    reader = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    pool = HostPool(MIB, device, reader=reader)  # one range: the new tensor must take it
    source = pool.empty((MIB,), torch.uint8)
    assert source.is_pinned()
    source.fill_(1)
    address = source.data_ptr()
    out = torch.empty(MIB, dtype=torch.uint8, device=device)
    with torch.cuda.stream(reader):
        torch.cuda._sleep(200_000_000)  # type: ignore[no-untyped-call]  # ~0.1 s at 2 GHz
        out.copy_(source, non_blocking=True)
    del source
    reused = pool.empty((MIB,), torch.uint8)
    assert reused.data_ptr() == address
    reused.fill_(2)
    reader.synchronize()
    assert bool((out == 1).all())
