"""The model shapes the executor benchmarks run (synthetic weights of a real layer's shape)."""

from __future__ import annotations

from executor_service.synthetic import SyntheticBase

SHAPES = {
    "qwen3-30b-a3b": SyntheticBase(
        "qwen3_moe",
        hidden_size=2048,
        moe_intermediate_size=768,
        num_experts=128,
        top_k=8,
        num_layers=1,
    ),
    # DeepSeek-V3's hidden and expert widths, top-8 of 32 experts (it has 256): the bytes a
    # layer's activations move per token, at a checkpoint that writes in seconds.
    "wide-7168": SyntheticBase(
        "qwen3_moe",
        hidden_size=7168,
        moe_intermediate_size=2048,
        num_experts=32,
        top_k=8,
        num_layers=1,
    ),
    "tiny": SyntheticBase("qwen3_moe", hidden_size=64, moe_intermediate_size=32, num_layers=1),
}
