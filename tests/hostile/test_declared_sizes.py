"""Numbers a client declares are bounded before anything is sized by them: a base model that
says 3,000,000 layers is refused without the registry's memory moving, and an adapter whose
lora_alpha scales its weights past what an executor can compute is refused at upload."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from moelora.client.errors import InvalidArgument
from moelora.client.model_spec import read_model_spec
from tests.hostile.conftest import HealthWatch
from tests.live_stack import BASE, Stack, rss_bytes

MIB = 1024 * 1024


@pytest.mark.parametrize(
    ("key", "value"),
    [("num_hidden_layers", 3_000_000), ("moe_intermediate_size", 10**9), ("hidden_size", 2**40)],
)
def test_a_base_model_declaring_huge_sizes_costs_nothing(
    authed_stack: Stack, key: str, value: int
) -> None:
    assert authed_stack.registry is not None
    pid = authed_stack.registry.proc.pid
    spec = read_model_spec(authed_stack.world.checkpoint)
    config = json.loads(spec.config_json) | {key: value}
    message = spec.to_proto("huge")
    message.config_json = json.dumps(config)
    before = rss_bytes(pid)
    with (
        HealthWatch(authed_stack.registry_address) as health,
        authed_stack.registry_client() as client,
        pytest.raises(InvalidArgument, match=rf"{key}={value} is outside 1-"),
    ):
        client.register_base_model(message)
    growth = (rss_bytes(pid) - before) / MIB
    print(f"\nRegisterBaseModel {key}={value}: INVALID_ARGUMENT, RSS +{growth:.1f} MiB")
    assert growth < 8
    health.check()


@pytest.mark.parametrize("alpha", [1e38, 1e6])
def test_an_adapter_scaled_past_float16_is_refused(
    authed_stack: Stack, tmp_path: Path, alpha: float
) -> None:
    adapter = tmp_path / "loud"
    shutil.copytree(authed_stack.world.adapter_dir / "alpha", adapter)
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(
        json.dumps(config | {"lora_alpha": alpha, "alpha_pattern": {}})
    )
    with authed_stack.registry_client() as client:
        with pytest.raises(InvalidArgument, match=r"lora_B.weight: scaled by lora_alpha / r"):
            client.upload(adapter, "loud", BASE)
        assert not list(client.list_versions(name="loud"))
