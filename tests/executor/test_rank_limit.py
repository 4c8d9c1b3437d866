"""An adapter whose rank no slot holds is refused once the registry names its rank, before a
byte of it is downloaded: FAILED_PRECONDITION naming the rank and --max-rank, and a warning."""

from __future__ import annotations

import logging

import pytest
import torch

from moelora.client.errors import FailedPrecondition
from moelora.client.registry import RegistryClient
from tests.executor.conftest import BASE, RegistrySetup, running_executor


def test_a_rank_above_max_rank_is_refused_before_the_download(
    registry_setup: RegistrySetup, caplog: pytest.LogCaptureFixture
) -> None:
    with RegistryClient(registry_setup.registry) as registry:
        version = registry.upload(registry_setup.adapter, "wide", BASE)
    assert version.rank == 8
    layer = registry_setup.spec.moe_layers[0]
    hidden = torch.zeros(2, registry_setup.spec.hidden_size)
    with running_executor(registry_setup, max_rank=4) as running:
        cache = running.app.settings.disk_cache_dir
        with caplog.at_level(logging.WARNING, "executor_service.adapters"):
            with pytest.raises(FailedPrecondition) as refused:
                running.client.forward(layer, hidden, [(2, "wide")])
            with pytest.raises(FailedPrecondition):
                running.client.load_adapter("wide")
        assert "rank 8, above this executor's --max-rank 4" in refused.value.message
        assert not cache.exists() or not any(cache.iterdir())  # nothing fetched
        assert running.metric("moelora_executor_adapter_misses_total", tier="host") == 0
    refusals = [r for r in caplog.records if r.msg == "adapter_refused"]
    assert len(refusals) == 2
    assert refusals[0].moelora_fields == {"adapter": "wide:1", "rank": 8, "max_rank": 4}  # type: ignore[attr-defined]
