"""The GPU serving path: CUDA-graph replay equals the eager launch bit for bit, and requests
merged into one launch (graphs, pinned staging) match each request alone within bf16."""

from __future__ import annotations

import threading

import pytest
import torch

from executor_service.client import ExecutorClient, ForwardResult
from executor_service.graphs import GraphCache
from executor_service.model_loader import load_base_model
from kernels import LoRAContext, LoRASlots, MoELayerWeights, Routing, moe_forward
from kernels.synthetic import relative_error
from tests.executor.conftest import StartExecutor
from tests.executor.test_parity import GPU_BFLOAT16_RELATIVE
from tests.executor.worlds import TOKENS, World

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _triton(
    hidden: torch.Tensor, layer: MoELayerWeights, lora: LoRAContext | None, routing: Routing | None
) -> torch.Tensor:
    return moe_forward(hidden, layer, lora, routing, backend="triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_graph_replay_equals_eager_bit_for_bit(qwen_world: World, dtype: torch.dtype) -> None:
    device = torch.device("cuda")
    model = load_base_model(qwen_world.checkpoint, device, dtype)
    index, layer = next(iter(model.layers.items()))
    e, h, inter, slots, rank = layer.num_experts, layer.hidden_size, layer.intermediate_size, 3, 4
    generator = torch.Generator().manual_seed(5)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=generator).to(device, dtype)

    lora = LoRASlots(
        a13=rand(slots, e, rank, h),
        b13=rand(slots, e, 2 * inter, rank),
        a2=rand(slots, e, rank, inter),
        b2=rand(slots, e, h, rank),
        enabled=torch.ones(slots, dtype=torch.int32, device=device),
    )
    graphs = GraphCache(_triton, model.layers, lambda _: lora, device, dtype)
    for tokens in (1, 5, 16, 100):
        bucket = graphs.bucket(tokens)
        assert bucket is not None and bucket >= tokens
        graph = graphs.get(index, bucket)
        assert graph is not None, "capture failed"
        x = rand(bucket, h)
        token_slots = torch.randint(-1, slots, (bucket,), generator=generator).to(device)
        token_slots = token_slots.to(torch.int32)
        token_slots[tokens:] = -1
        graph.input.copy_(x)
        graph.slots.copy_(token_slots)
        graph.replay()
        eager = _triton(x, layer, LoRAContext(lora, token_slots), None)
        torch.cuda.synchronize()
        assert torch.equal(graph.output, eager), f"T={tokens} (bucket {bucket}) differs"
    assert graphs.captured_bytes >= 0


def test_merged_requests_match_each_alone_on_the_gpu(
    qwen_world: World, start_executor: StartExecutor
) -> None:
    """bf16 serving with graphs and batching: each request merged equals it alone within the
    bf16 tolerance, alone equals the PEFT reference within it, and launches were graphs."""
    running = start_executor(
        qwen_world, device="cuda", dtype="bfloat16", num_slots=6, batch_window_us=200_000
    )
    layer = qwen_world.moe_layers[0]
    hidden = qwen_world.inputs[layer]
    mixes: list[list[tuple[int, str | None]]] = [
        [(TOKENS, "alpha")],
        [(5, "beta"), (7, None)],
        [(3, None), (4, "gamma"), (5, "alpha")],
        [(TOKENS, None)],
    ]
    alone = [running.client.forward(layer, hidden, m) for m in mixes]
    for mix, result in zip(mixes, alone, strict=True):
        error = relative_error(result.output, qwen_world.expected(layer, mix))
        assert error < GPU_BFLOAT16_RELATIVE, (mix, error)
    merged: dict[int, ForwardResult] = {}
    barrier = threading.Barrier(len(mixes))

    def work(index: int) -> None:
        with ExecutorClient(running.app.address, timeout=60) as client:
            barrier.wait(10)
            merged[index] = client.forward(layer, hidden, mixes[index])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(mixes))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(merged) == len(mixes)
    count = running.metric("moelora_executor_batch_requests_count")
    assert running.metric("moelora_executor_batch_requests_sum") > count, "nothing merged"
    for index, result in merged.items():
        error = relative_error(result.output, alone[index].output)
        assert error < GPU_BFLOAT16_RELATIVE, (mixes[index], error)
    assert running.metric("moelora_executor_forward_runs_total", mode="graph") > 0
