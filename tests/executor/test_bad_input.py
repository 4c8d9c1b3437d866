"""Bad Forward requests get the documented status code with a message naming the field, and
the executor keeps serving: the next good request is answered correctly."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
import torch

from moelora.client import torch_tensors as torch_codec
from moelora.client.executor import forward_request
from moelora.v1 import executor_pb2, executor_pb2_grpc, tensor_pb2
from tests.executor.conftest import FOREIGN, Running, assert_close, running_executor
from tests.executor.worlds import TOKENS, World

MAX_TOKENS = 64

Mutation = Callable[[executor_pb2.ForwardRequest, World], object]


def _hidden(request: executor_pb2.ForwardRequest, tensor: torch.Tensor) -> None:
    request.hidden_states.CopyFrom(torch_codec.from_torch(tensor))


def _routing(request: executor_pb2.ForwardRequest, ids: Any, weights: Any) -> None:
    request.routing.topk_ids.CopyFrom(torch_codec.from_torch(torch.as_tensor(ids)))
    request.routing.topk_weights.CopyFrom(torch_codec.from_torch(torch.as_tensor(weights)))


def _good_routing(world: World, tokens: int = TOKENS) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.arange(world.top_k, dtype=torch.int32).repeat(tokens, 1)
    return ids, torch.full((tokens, world.top_k), 1.0 / world.top_k)


CASES: dict[str, tuple[Mutation, grpc.StatusCode, str]] = {
    "wrong hidden size": (
        lambda r, w: _hidden(r, torch.zeros(TOKENS, 40)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "hidden_states.shape",
    ),
    "hidden not 2-D": (
        lambda r, w: _hidden(r, torch.zeros(2, TOKENS, 48)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "hidden_states.shape",
    ),
    "bad byte length": (
        lambda r, w: r.hidden_states.MergeFrom(tensor_pb2.Tensor(data=b"\0\0")),
        grpc.StatusCode.INVALID_ARGUMENT,
        "hidden_states.data",
    ),
    "integer hidden states": (
        lambda r, w: _hidden(r, torch.zeros(TOKENS, 48, dtype=torch.int32)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "hidden_states.dtype",
    ),
    "no tokens": (
        lambda r, w: _hidden(r, torch.zeros(0, 48)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "hidden_states",
    ),
    "too many tokens": (
        lambda r, w: _hidden(r, torch.zeros(MAX_TOKENS + 1, 48)),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "max_tokens_per_request",
    ),
    "layer out of range": (
        lambda r, w: setattr(r, "layer", 99),
        grpc.StatusCode.INVALID_ARGUMENT,
        "layer",
    ),
    "dense layer": (
        lambda r, w: setattr(r, "layer", w.dense_layers[0]),
        grpc.StatusCode.INVALID_ARGUMENT,
        "not a MoE layer",
    ),
    "segments do not sum to T": (
        lambda r, w: r.segments.add(num_tokens=TOKENS + 1, adapter="alpha"),
        grpc.StatusCode.INVALID_ARGUMENT,
        "segments",
    ),
    "empty segment": (
        lambda r, w: r.segments.extend(
            [executor_pb2.Segment(num_tokens=0), executor_pb2.Segment(num_tokens=TOKENS)]
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
        "segments[0].num_tokens",
    ),
    "malformed adapter reference": (
        lambda r, w: r.segments.add(num_tokens=TOKENS, adapter="../etc"),
        grpc.StatusCode.INVALID_ARGUMENT,
        "segments[0].adapter",
    ),
    "unknown adapter": (
        lambda r, w: r.segments.add(num_tokens=TOKENS, adapter="nosuch"),
        grpc.StatusCode.NOT_FOUND,
        "nosuch",
    ),
    "unknown version": (
        lambda r, w: r.segments.add(num_tokens=TOKENS, adapter="alpha:7"),
        grpc.StatusCode.NOT_FOUND,
        "alpha:7",
    ),
    "adapter for another base model": (
        lambda r, w: r.segments.add(num_tokens=TOKENS, adapter=FOREIGN),
        grpc.StatusCode.FAILED_PRECONDITION,
        "foreign:1",
    ),
    "more distinct adapters than slots": (
        lambda r, w: r.segments.extend(
            [
                executor_pb2.Segment(num_tokens=2, adapter=name)
                for name in ("alpha", "beta", "gamma", "delta", "eps", "eta")
            ]
        ),
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "split the request",
    ),
    "routing ids of the wrong shape": (
        lambda r, w: _routing(r, torch.zeros(TOKENS, 1, dtype=torch.int32), torch.ones(TOKENS, 1)),
        grpc.StatusCode.INVALID_ARGUMENT,
        "routing.topk_ids.shape",
    ),
    "routing ids as floats": (
        lambda r, w: _routing(r, _good_routing(w)[0].float(), _good_routing(w)[1]),
        grpc.StatusCode.INVALID_ARGUMENT,
        "routing.topk_ids.dtype",
    ),
    "routing expert id out of range": (
        lambda r, w: _routing(r, _good_routing(w)[0] + w.num_experts - 1, _good_routing(w)[1]),
        grpc.StatusCode.INVALID_ARGUMENT,
        "routing.topk_ids",
    ),
    "routing weights in float16": (
        lambda r, w: _routing(r, _good_routing(w)[0], _good_routing(w)[1].half()),
        grpc.StatusCode.INVALID_ARGUMENT,
        "routing.topk_weights.dtype",
    ),
    "routing without weights": (
        lambda r, w: r.routing.topk_ids.CopyFrom(torch_codec.from_torch(_good_routing(w)[0])),
        grpc.StatusCode.INVALID_ARGUMENT,
        "routing.topk_weights",
    ),
}


@pytest.fixture(scope="module")
def executor(qwen_world: World) -> Iterator[Running]:
    """One executor takes every bad request in turn."""
    with running_executor(qwen_world, max_tokens_per_request=MAX_TOKENS) as running:
        yield running


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_request_gets_its_code_and_the_next_request_works(
    qwen_world: World, executor: Running, case: str
) -> None:
    mutate, code, needle = CASES[case]
    layer = qwen_world.moe_layers[0]
    hidden = qwen_world.inputs[layer]
    request = forward_request(layer, hidden)
    mutate(request, qwen_world)
    with grpc.insecure_channel(executor.app.address) as channel:
        stub = executor_pb2_grpc.ExecutorStub(channel)
        with pytest.raises(grpc.RpcError) as failure:
            stub.Forward(request, timeout=30)
    assert failure.value.code() == code, failure.value.details()
    assert needle in failure.value.details()
    good = executor.client.forward(layer, hidden, [(TOKENS, "alpha")])
    assert_close(good.output, qwen_world.reference[("alpha", layer)])
