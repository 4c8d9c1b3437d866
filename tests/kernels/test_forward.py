"""The entry point's contract: backends, empty batches, validation errors."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels import moe_forward
from kernels.forward import Backend
from kernels.reference import moe_forward_reference
from kernels.synthetic import (
    lora_context,
    random_hidden,
    random_layer,
    random_routing,
    random_slots,
    round_robin_slots,
)
from kernels.types import LoRAContext, MoELayerWeights, Routing

from .conftest import DEVICE


def _setup(
    dtype: torch.dtype = torch.float32, device: str = DEVICE
) -> tuple[torch.Tensor, MoELayerWeights, LoRAContext]:
    layer = random_layer(5, 32, 16, 2, dtype=dtype, device=device)
    slots = random_slots(layer, 3, 8)
    return (
        random_hidden(6, 32, dtype=dtype, device=device),
        layer,
        lora_context(slots, round_robin_slots(6, 3)),
    )


def test_torch_backend_is_the_reference() -> None:
    hidden, layer, lora = _setup()
    got = moe_forward(hidden, layer, lora, backend="torch")
    assert torch.equal(got, moe_forward_reference(hidden, layer, lora))


def test_empty_batch() -> None:
    hidden, layer, lora = _setup()
    empty = hidden[:0]
    lora0 = dataclasses.replace(lora, token_slots=lora.token_slots[:0])
    backends: tuple[Backend, ...] = ("triton", "torch")
    for backend in backends:
        out = moe_forward(empty, layer, lora0, backend=backend)
        assert out.shape == (0, 32)


def test_triton_backend_refuses_cpu_tensors_without_interpreter(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hidden, layer, _ = _setup()
    if hidden.is_cuda:
        pytest.skip("tensors are on the GPU here")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="backend='torch'"):
        moe_forward(hidden, layer)


Inputs = tuple[torch.Tensor, MoELayerWeights, LoRAContext | None, Routing | None]


def _bad_inputs() -> dict[str, Inputs]:
    hidden, layer, lora = _setup()
    routing = random_routing(6, 5, 2, device=DEVICE)
    slots = lora.slots
    # Index ranges are checked only where that costs no GPU synchronisation (CPU tensors):
    # on a GPU the out-of-range launch would fault the context for the tests after it.
    cpu_hidden, cpu_layer, cpu_lora = _setup(device="cpu")
    cpu_routing = random_routing(6, 5, 2, device="cpu")
    return {
        "hidden states have H=": (hidden[:, :16], layer, None, None),
        "hidden states are": (hidden.half(), layer, None, None),
        "topk_ids must be int32": (
            hidden, layer, None, Routing(routing.topk_ids.long(), routing.topk_weights)
        ),
        r"topk_ids must have shape \(6, 2\)": (
            hidden, layer, None, Routing(routing.topk_ids[:, :1], routing.topk_weights[:, :1])
        ),
        "topk_ids values must lie in": (
            cpu_hidden, cpu_layer, None,
            Routing(cpu_routing.topk_ids + 5, cpu_routing.topk_weights),
        ),
        "token_slots values must lie in": (
            cpu_hidden, cpu_layer,
            dataclasses.replace(cpu_lora, token_slots=cpu_lora.token_slots + 3), None,
        ),
        r"LoRA b13 must have shape": (
            hidden, layer, dataclasses.replace(
                lora, slots=dataclasses.replace(slots, b13=slots.b13[:, :, :8])
            ), None,
        ),
        "LoRA a2 must be": (
            hidden, layer, dataclasses.replace(
                lora, slots=dataclasses.replace(slots, a2=slots.a2.half())
            ), None,
        ),
        "w2 must have shape": (
            hidden, dataclasses.replace(layer, w2=layer.w2[:, :, :8]), None, None
        ),
        "b13 must have shape": (
            hidden, dataclasses.replace(layer, b13=torch.zeros(5, 3)), None, None
        ),
    }  # fmt: skip


@pytest.mark.parametrize("message", list(_bad_inputs()))
@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_invalid_inputs_raise_value_error(message: str, backend: Backend) -> None:
    hidden, layer, lora, routing = _bad_inputs()[message]
    with pytest.raises(ValueError, match=message):
        moe_forward(hidden, layer, lora, routing, backend=backend)
