"""The CUDA-graph buckets follow --max-batch-tokens: every merged launch has a graph."""

from __future__ import annotations

import pytest

from executor_service.graphs import BUCKETS, graph_buckets


def test_the_default_is_powers_of_two_up_to_512() -> None:
    assert graph_buckets(512) == BUCKETS == (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


@pytest.mark.parametrize("limit", [1, 2, 3, 100, 512, 768, 2048, 5000])
def test_every_launch_size_up_to_the_limit_has_a_bucket_close_above_it(limit: int) -> None:
    buckets = graph_buckets(limit)
    assert list(buckets) == sorted(set(buckets)) and buckets[-1] == limit
    for tokens in range(1, limit + 1):
        smallest = min(b for b in buckets if b >= tokens)
        assert smallest < 2 * tokens or smallest == 1  # never more than twice the work
