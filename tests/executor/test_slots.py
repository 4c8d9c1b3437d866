"""Slot buffers, the slot table and the host cache, driven directly (CPU, no network)."""

from __future__ import annotations

import threading

import pytest
import torch

from executor_service.host_cache import HostCache
from executor_service.host_pool import HostPool
from executor_service.packer import PackedAdapter, PackedLayer
from executor_service.slot_buffers import DeviceSync, SlotBuffers
from executor_service.slots import LRUPolicy, SlotLease, SlotManager, Wanted
from executor_service.sources import ResolvedAdapter
from kernels import MoELayerWeights, RouterKind, RouterSpec
from moelora.client.errors import FailedPrecondition, ResourceExhausted

E, H, INTER, R = 3, 8, 5, 4
LAYERS = (1, 3)


def _layer() -> MoELayerWeights:
    return MoELayerWeights(
        router=RouterSpec(RouterKind.SOFTMAX_TOPK, top_k=2, renormalize=True),
        router_weight=torch.zeros(E, H),
        w13=torch.zeros(E, 2 * INTER, H),
        w2=torch.zeros(E, H, INTER),
    )


def _packed(seed: int, rank: int = 2, layers: tuple[int, ...] = LAYERS) -> PackedAdapter:
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator)

    parts = {
        layer: PackedLayer(
            a13=rand(E, rank, H),
            b13=rand(E, 2 * INTER, rank),
            a2=rand(E, rank, INTER),
            b2=rand(E, H, rank),
        )
        for layer in layers
    }
    nbytes = sum(
        t.numel() * t.element_size()
        for p in parts.values()
        for t in (p.a13, p.b13, p.a2, p.b2)
        if t is not None
    )
    return PackedAdapter(layers=parts, rank=rank, nbytes=nbytes)


def _given(tensor: torch.Tensor | None) -> torch.Tensor:
    assert tensor is not None
    return tensor


def _adapter(index: int) -> ResolvedAdapter:
    return ResolvedAdapter(f"a{index}", 1, f"sha256:{index:064x}")


def _manager(slots: int) -> SlotManager:
    layers = {layer: _layer() for layer in LAYERS}
    sync = DeviceSync(torch.device("cpu"))
    return SlotManager(SlotBuffers(layers, slots, R, torch.float32, sync), LRUPolicy())


def _acquire(
    manager: SlotManager,
    adapters: list[ResolvedAdapter],
    data: dict[str, PackedAdapter],
    timeout: float,
    fetched: list[ResolvedAdapter] | None = None,
) -> SlotLease:
    """Acquires with the packed data of ``data`` in hand for adapters not in a slot; any
    other the manager fetches from ``data`` (recorded in ``fetched``)."""

    def fetch(adapter: ResolvedAdapter) -> PackedAdapter:
        if fetched is not None:
            fetched.append(adapter)
        return data[adapter.digest]

    wanted = [Wanted(a, None if manager.holds(a.digest) else data.get(a.digest)) for a in adapters]
    return manager.acquire(wanted, fetch, timeout)


def test_write_pads_the_rank_with_zeros_and_sets_enabled() -> None:
    manager = _manager(2)
    old, new = _adapter(0), _adapter(1)
    full = _packed(0, rank=R)
    # Rank 2, layer 3 only, and no gate_up LoRA there: everything else must be zero.
    part = _packed(1, rank=2, layers=(3,)).layers[3]
    small = PackedAdapter(
        layers={3: PackedLayer(a13=None, b13=None, a2=part.a2, b2=part.b2)}, rank=2, nbytes=1
    )
    lease = _acquire(manager, [old], {old.digest: full}, 1.0)
    manager.release(lease, None)
    _acquire(manager, [_adapter(9)], {_adapter(9).digest: full}, 1.0)  # fills the other slot
    lease = _acquire(manager, [new], {new.digest: small}, 1.0)  # evicts ``old`` (LRU)
    slot = lease.slots[new.digest]
    assert lease.evicted == (old,)
    one, three = manager.buffers.layer(1), manager.buffers.layer(3)
    assert int(one.enabled[slot]) == 0 and int(three.enabled[slot]) == 1
    for tensor in (one.a13, one.b13, one.a2, one.b2, three.a13, three.b13):
        assert not tensor[slot].any()
    assert torch.equal(three.a2[slot, :, :2], _given(part.a2))
    assert torch.equal(three.b2[slot, :, :, :2], _given(part.b2))
    assert not three.a2[slot, :, 2:].any() and not three.b2[slot, :, :, 2:].any()


def test_a_slot_in_use_is_never_evicted_and_waiters_get_it_once_released() -> None:
    manager = _manager(2)
    a, b, c = _adapter(0), _adapter(1), _adapter(2)
    data = {x.digest: _packed(i) for i, x in enumerate((a, b, c))}
    held_a = _acquire(manager, [a], data, 1.0)
    held_b = _acquire(manager, [b], data, 1.0)
    with pytest.raises(ResourceExhausted, match="in use by requests in flight"):
        _acquire(manager, [c], data, 0.1)
    threading.Timer(0.2, manager.release, args=(held_a, None)).start()
    lease = _acquire(manager, [c], data, 5.0)
    assert lease.slots[c.digest] == held_a.slots[a.digest]
    assert lease.evicted == (a,)
    slot = lease.slots[c.digest]
    assert torch.equal(
        manager.buffers.layer(1).a13[slot, :, :2], _given(data[c.digest].layers[1].a13)
    )
    # b, still held, kept its slot and its contents.
    slot_b = held_b.slots[b.digest]
    assert torch.equal(
        manager.buffers.layer(1).a13[slot_b, :, :2], _given(data[b.digest].layers[1].a13)
    )


def test_pins_capacity_and_missing_data() -> None:
    manager = _manager(3)
    adapters = [_adapter(i) for i in range(4)]
    data = {x.digest: _packed(i) for i, x in enumerate(adapters)}
    for adapter in adapters[:2]:
        manager.release(_acquire(manager, [adapter], data, 1.0), None)
        manager.pin(adapter.digest)
    manager.release(_acquire(manager, [adapters[2]], data, 1.0), None)
    with pytest.raises(ResourceExhausted, match="one must stay unpinned"):
        manager.pin(adapters[2].digest)
    # Two pinned by other adapters leave one slot: a batch of two new adapters can never run.
    with pytest.raises(ResourceExhausted, match="split the request"):
        _acquire(manager, adapters[2:], data, 1.0)
    # ... but one that includes the pinned ones can.
    manager.release(_acquire(manager, [*adapters[:2], adapters[3]], data, 1.0), None)
    with pytest.raises(FailedPrecondition, match="pinned"):
        manager.evict(adapters[0].digest, 1.0)
    # Data the caller lacks (the adapter left its slot after the caller looked) is fetched.
    fetched: list[ResolvedAdapter] = []
    late = _adapter(7)
    wanted = [Wanted(late, None)]

    def fetch(adapter: ResolvedAdapter) -> PackedAdapter:
        fetched.append(adapter)
        return _packed(7)

    manager.release(manager.acquire(wanted, fetch, 1.0), None)
    assert fetched == [late] and manager.holds(late.digest)
    assert manager.unpin(adapters[0].digest) is not None
    assert manager.evict(adapters[0].digest, 1.0) is not None
    assert not manager.holds(adapters[0].digest)


def test_host_cache_lru_within_budget() -> None:
    sizes = _packed(0).nbytes
    cache = HostCache(budget_bytes=2 * sizes, memory=HostPool(0, torch.device("cpu")))
    a, b, c = _adapter(0), _adapter(1), _adapter(2)
    cache.put(a, _packed(0))
    cache.put(b, _packed(1))
    assert cache.get(a.digest) is not None  # b is now the least recently used
    put = cache.put(c, _packed(2))
    assert put.stored and put.evicted == (b,)
    assert [e.adapter for e in cache.entries()] == [a, c]
    assert cache.used_bytes == 2 * sizes
    huge = cache.put(_adapter(3), _packed(3, rank=R * 4))
    assert not huge.stored and huge.evicted == ()
    assert cache.remove(a.digest) is not None and cache.used_bytes == sizes
