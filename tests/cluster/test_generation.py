"""``model.generate()`` with the MoE blocks served by executor processes, one layer group per
process (≥ 3 processes), equals generation with PEFT locally, token for token (greedy), in a
batch whose rows use different adapters and none.

Covered: qwen3_moe, qwen2_moe, mixtral. Not covered: olmoe's tiny config fails inside
transformers' own attention (its q/k norm expects hidden_size = heads · head_dim), and
gpt_oss / deepseek_v3 generation is not tried here; the MoE blocks of all of them are
covered against PEFT by tests/executor/test_parity.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moelora.client.cluster import ClusterClient
from moelora.client.cluster.hf import attach_remote_experts
from tests.cluster.conftest import StartReplicas
from tests.formats.hf_models import build_model, save_model
from tests.formats.peft_adapters import load_peft_adapter, make_peft_adapter

NEW_TOKENS = 6
#: Per model type: each process's --layers (3 decoder layers; qwen3_moe's layer 1 is dense).
GROUPS = {
    "qwen3_moe": ["0", "2", "2"],
    "qwen2_moe": ["0", "1", "2"],
    "mixtral": ["0", "1", "2"],
}
ROWS: list[str | None] = ["alpha", None, "beta", "alpha"]


def _generate(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        tokens: torch.Tensor = model.generate(  # type: ignore[operator]
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
    return tokens[:, input_ids.shape[1] :]


@pytest.mark.parametrize("model_type", sorted(GROUPS))
def test_remote_experts_generate_as_peft(
    model_type: str, tmp_path: Path, start_replicas: StartReplicas
) -> None:
    checkpoint = save_model(build_model(model_type), tmp_path / "base")
    adapters = tmp_path / "adapters"
    for seed, name in enumerate(["alpha", "beta"], start=1):
        make_peft_adapter(model_type, "both", adapters / name, seed=seed)
    replicas = start_replicas(checkpoint, adapters, [("127.0.0.1", g) for g in GROUPS[model_type]])
    input_ids = torch.randint(1, 32, (len(ROWS), 5), generator=torch.Generator().manual_seed(3))

    expected = []
    for row, adapter in enumerate(ROWS):
        local = (
            build_model(model_type)
            if adapter is None
            else load_peft_adapter(model_type, adapters / adapter)
        )
        expected.append(_generate(local, input_ids[row : row + 1])[0])

    model = build_model(model_type)
    with ClusterClient([r.address for r in replicas]) as cluster:
        experts = attach_remote_experts(model, cluster)
        assert experts.layers == sorted(cluster.layers())
        with experts.using(ROWS):
            remote = _generate(model, input_ids)
        stats = cluster.stats
    assert stats.requests > 0
    assert remote.tolist() == torch.stack(expected).tolist()
