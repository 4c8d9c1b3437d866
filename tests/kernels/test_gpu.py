"""The Triton path on a GPU: bf16 at the benchmark's layer shapes, exact fp32, CUDA graphs.

Skipped without CUDA. Run on the device with ``pytest tests/kernels -m gpu``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest
import torch

from kernels import ConfigSelector, moe_forward
from kernels.autotune import autotune
from kernels.bench import SHAPES as BENCH_SHAPES
from kernels.bench import ZOO
from kernels.forward import fused_moe, layer_shape
from kernels.heuristic import heuristic_config
from kernels.reference import moe_forward_reference
from kernels.synthetic import (
    lora_context,
    random_hidden,
    random_layer,
    random_routing,
    random_slots,
)
from kernels.types import LoRAContext, MoELayerWeights

from .conftest import assert_rows_close
from .test_fused_moe import CASES, DECODE_CASES, _decode_case, _inputs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.usefixtures("poison_allocations"),
]


@pytest.fixture(autouse=True)
def _return_cached_memory() -> Iterator[None]:
    """The zoo's largest layer draws 28 GiB of float32 at once (DeepSeek-V3's w13): what the
    test before left in torch's cache, in blocks a little too small, must go back first."""
    yield
    torch.cuda.empty_cache()


# (E, H, I, k) of the benchmark's layers and its zoo (kernels.bench.SHAPES and ZOO).
SHAPES = {key: (s.experts, s.hidden, s.inter, s.top_k) for key, s in (BENCH_SHAPES | ZOO).items()}


def _lora(layer: MoELayerWeights, tokens: int, rank: int = 16) -> LoRAContext:
    slots = random_slots(layer, 8, rank, enabled=[True] * 7 + [False])
    # Adapters round-robin over slots 0..4, every 5th token without one, slot 7 disabled.
    token_slots = torch.tensor([(t % 6) - 1 if t % 6 else 7 for t in range(tokens)])
    return lora_context(slots, token_slots.to(torch.int32))


@pytest.mark.parametrize("tokens", [1, 37, 512])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_real_shapes_bf16(shape: str, tokens: int) -> None:
    e, h, i, k = SHAPES[shape]
    layer = random_layer(e, h, i, k, dtype=torch.bfloat16, device="cuda")
    hidden = random_hidden(tokens, h, dtype=torch.bfloat16, device="cuda")
    routing = random_routing(tokens, e, k, device="cuda")
    lora = _lora(layer, tokens)
    for context in (lora, None):
        expected = moe_forward_reference(hidden, layer, context, routing)
        assert_rows_close(
            moe_forward(hidden, layer, context, routing), expected, f"{shape} M={tokens}"
        )


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs a second GPU")
def test_tensors_on_a_gpu_other_than_the_current_one() -> None:
    """A model placed on cuda:1 calls the kernels while cuda:0 is current: they launch on
    the tensors' GPU (Triton takes the current device's context otherwise) and answer as there."""
    e, h, i, k = SHAPES["qwen3"]
    layer = random_layer(e, h, i, k, dtype=torch.bfloat16, device="cuda:1")
    hidden = random_hidden(37, h, dtype=torch.bfloat16, device="cuda:1")
    lora = _lora(layer, 37)
    routing = random_routing(37, e, k, device="cuda:1")
    with torch.cuda.device(0):
        out = moe_forward(hidden, layer, lora, routing)
    assert out.device == torch.device("cuda:1")
    assert_rows_close(out, moe_forward_reference(hidden, layer, lora, routing), "on cuda:1")


@pytest.mark.parametrize("tokens", [1, 4])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_decode_real_shapes_bf16(shape: str, tokens: int) -> None:
    e, h, i, k = SHAPES[shape]
    layer = random_layer(e, h, i, k, dtype=torch.bfloat16, device="cuda", seed=tokens)
    hidden = random_hidden(tokens, h, dtype=torch.bfloat16, device="cuda")
    routing = random_routing(tokens, e, k, device="cuda")
    config = dataclasses.replace(heuristic_config(tokens, e, h, i, k), decode=True)
    lora = _lora(layer, tokens)
    for context in (lora, None):
        expected = moe_forward_reference(hidden, layer, context, routing)
        assert_rows_close(
            fused_moe(hidden, layer, context, routing, config), expected, f"{shape} M={tokens}"
        )


@pytest.mark.parametrize("name", DECODE_CASES)
def test_decode_edge_cases_bf16(name: str) -> None:
    case = dataclasses.replace(_decode_case(name), dtype=torch.bfloat16)
    hidden, layer, lora, routing = _inputs(case, seed=3)
    for context in (lora, None):
        expected = moe_forward_reference(hidden, layer, context, routing)
        got = fused_moe(hidden, layer, context, routing, case.config(atomic_sum=False))
        assert_rows_close(got, expected, f"{name}")


@pytest.mark.parametrize("split_k", [1, 3])
@pytest.mark.parametrize(("shape", "tokens"), [("qwen3", 4096), ("gpt_oss", 512), ("mixtral", 1)])
def test_persistent_and_split_k_at_real_shapes(shape: str, tokens: int, split_k: int) -> None:
    """Persistent programs loop over many tiles at real sizes (a wave of 132 programs cannot
    hold the work); w2's K split into parts that add into the atomic sum."""
    e, h, i, k = SHAPES[shape]
    layer = random_layer(e, h, i, k, dtype=torch.bfloat16, device="cuda")
    hidden = random_hidden(tokens, h, dtype=torch.bfloat16, device="cuda")
    routing = random_routing(tokens, e, k, device="cuda")
    base = heuristic_config(tokens, e, h, i, k)
    config = dataclasses.replace(
        base,
        atomic_sum=True,
        w13=dataclasses.replace(base.w13, persistent=1),
        w2=dataclasses.replace(base.w2, persistent=2, split_k=split_k),
    )
    lora = _lora(layer, tokens)
    for context in (lora, None):
        expected = moe_forward_reference(hidden, layer, context, routing)
        assert_rows_close(
            fused_moe(hidden, layer, context, routing, config), expected, f"{shape} M={tokens}"
        )


@pytest.mark.parametrize("tokens", [1, 64, 4096])
def test_rank_384_at_a_real_shape(tokens: int) -> None:
    """Large ranks go 64 at a time (they once asked for 532 KB of shared memory)."""
    e, h, i, k = SHAPES["qwen3"]
    layer = random_layer(e, h, i, k, dtype=torch.bfloat16, device="cuda")
    hidden = random_hidden(tokens, h, dtype=torch.bfloat16, device="cuda")
    routing = random_routing(tokens, e, k, device="cuda")
    lora = _lora(layer, tokens, rank=384)
    expected = moe_forward_reference(hidden, layer, lora, routing)
    assert_rows_close(moe_forward(hidden, layer, lora, routing), expected, f"M={tokens}")


@pytest.mark.parametrize("atomic_sum", [True, False])
@pytest.mark.parametrize("name", list(CASES))
def test_edge_cases_bf16(name: str, atomic_sum: bool) -> None:
    case = dataclasses.replace(CASES[name], dtype=torch.bfloat16)
    hidden, layer, lora, routing = _inputs(case, seed=3)
    for context in (lora, None):
        expected = moe_forward_reference(hidden, layer, context, routing)
        got = fused_moe(hidden, layer, context, routing, case.config(atomic_sum))
        assert_rows_close(got, expected, f"{name}")


def test_float32_is_exact_on_the_gpu() -> None:
    """fp32 weights run IEEE dots: the executor's float32 parity checks go through Triton."""
    layer = random_layer(16, 512, 256, 4, dtype=torch.float32, device="cuda", biases=True)
    hidden = random_hidden(200, 512, dtype=torch.float32, device="cuda")
    routing = random_routing(200, 16, 4, device="cuda")
    lora = _lora(layer, 200)
    for atomic_sum in (True, False):
        config = dataclasses.replace(
            heuristic_config(200, 16, 512, 256, 4, elem_size=4), atomic_sum=atomic_sum
        )
        got = fused_moe(hidden, layer, lora, routing, config)
        expected = moe_forward_reference(hidden, layer, lora, routing)
        assert_rows_close(got, expected, f"float32 atomic_sum={atomic_sum}")


def test_cuda_graph_replay_follows_new_inputs() -> None:
    """Everything (alignment included) runs on the GPU without host syncs: capturable."""
    e, h, i, k = SHAPES["qwen3"]
    layer = random_layer(e, h, i, k, dtype=torch.bfloat16, device="cuda")
    lora = _lora(layer, 64)
    hidden = random_hidden(64, h, dtype=torch.bfloat16, device="cuda")
    routing = random_routing(64, e, k, device="cuda")
    moe_forward(hidden, layer, lora, routing)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_forward(hidden, layer, lora, routing)
    new_hidden = random_hidden(64, h, dtype=torch.bfloat16, device="cuda", seed=9)
    new_routing = random_routing(64, e, k, device="cuda", seed=9)
    hidden.copy_(new_hidden)
    routing.topk_ids.copy_(new_routing.topk_ids)
    routing.topk_weights.copy_(new_routing.topk_weights)
    lora.token_slots.copy_(lora.token_slots.flip(0))
    graph.replay()
    expected = moe_forward_reference(hidden, layer, lora, routing)
    assert_rows_close(out, expected, "graph replay")


def test_autotune_in_budget_gives_correct_configs() -> None:
    """Start-up autotuning of a small layer: every bucket gets a configuration the selector
    then reports as autotuned, and the forward with it matches the reference."""
    layer = random_layer(16, 512, 256, 2, dtype=torch.bfloat16, device="cuda")
    result = autotune(layer, 16, budget_s=60, buckets=(1, 64, 600), num_slots=8, jobs=2)
    assert set(result.configs) == {1, 64, 600}
    assert result.timed >= 3
    selector = ConfigSelector("test-gpu", use_tables=False)
    selector.add(layer_shape(layer), 16, result.configs)
    for tokens in (1, 64, 600):
        hidden = random_hidden(tokens, 512, dtype=torch.bfloat16, device="cuda")
        routing = random_routing(tokens, 16, 2, device="cuda")
        lora = _lora(layer, tokens)
        assert selector.select(tokens, layer_shape(layer), 16, torch.bfloat16).source == "autotuned"
        out = moe_forward(hidden, layer, lora, routing, configs=selector)
        expected = moe_forward_reference(hidden, layer, lora, routing)
        assert_rows_close(out, expected, f"autotuned M={tokens}")
