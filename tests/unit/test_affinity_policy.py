"""The routing policy alone: rendezvous order, bounded-load assignment, batch keys."""

from __future__ import annotations

from collections import Counter

from moelora.client.cluster.policy import AffinityTable, batch_key, rendezvous

REPLICAS = ["10.0.0.1:50052", "10.0.0.2:50052", "10.0.0.3:50052"]
ADAPTERS = [f"adapter-{i}" for i in range(30)]


def test_rendezvous_moves_only_the_leaving_replicas_keys() -> None:
    before = {a: rendezvous(a, REPLICAS)[0] for a in ADAPTERS}
    after = {a: rendezvous(a, REPLICAS[:2])[0] for a in ADAPTERS}
    moved = {a for a in ADAPTERS if before[a] != after[a]}
    assert moved == {a for a in ADAPTERS if before[a] == REPLICAS[2]}
    assert rendezvous("x", REPLICAS) == rendezvous("x", list(reversed(REPLICAS)))


def test_bounded_load_spreads_adapters_evenly_and_sticks() -> None:
    table = AffinityTable(balance=1.0)
    first = {a: table.rank(a, REPLICAS)[0] for a in ADAPTERS}
    assert sorted(Counter(first.values()).values()) == [10, 10, 10]
    assert all(table.rank(a, REPLICAS)[0] == first[a] for a in ADAPTERS)
    assert sorted(table.rank(ADAPTERS[0], REPLICAS)) == sorted(REPLICAS)
    # Its replica gone, an adapter moves; the others stay.
    gone = first[ADAPTERS[0]]
    rest = [r for r in REPLICAS if r != gone]
    assert table.rank(ADAPTERS[0], rest)[0] in rest
    kept = [a for a in ADAPTERS if first[a] != gone]
    assert all(table.rank(a, rest)[0] == first[a] for a in kept)


def test_plain_rendezvous_is_the_unbounded_case() -> None:
    table = AffinityTable(balance=1e9)
    assert all(table.rank(a, REPLICAS)[0] == rendezvous(a, REPLICAS)[0] for a in ADAPTERS)


def test_batch_key_is_the_adapter_with_most_tokens() -> None:
    assert batch_key([(3, "b"), (5, None), (2, "a"), (2, "a")]) == "a"
    assert batch_key([(2, "b"), (2, "a")]) == "a"
    assert batch_key([(4, None)]) is None
    assert batch_key(None) is None
