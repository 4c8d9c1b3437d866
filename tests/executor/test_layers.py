"""--layers: an executor loads, packs and budgets only the MoE layers it serves, says which in
GetExecutorInfo, and refuses other layers with a message naming the ones it serves."""

from __future__ import annotations

import pytest

from moelora.client.errors import FailedPrecondition, InvalidArgument
from tests.executor.conftest import StartExecutor, assert_close
from tests.executor.worlds import World

ADAPTER = "alpha"


def test_serves_only_its_layers(qwen_world: World, start_executor: StartExecutor) -> None:
    first, last = qwen_world.moe_layers[0], qwen_world.moe_layers[-1]
    full = start_executor(qwen_world)
    part = start_executor(qwen_world, layers=str(last), replica_name="tail-0")

    info = part.client.get_executor_info()
    assert list(info.served_layers) == [last]
    assert info.replica_name == "tail-0"
    assert list(full.client.get_executor_info().served_layers) == list(qwen_world.moe_layers)
    # Slot buffers are allocated for the served layer alone.
    full_bytes = full.client.get_executor_info().slot_memory_bytes
    assert info.slot_memory_bytes * len(qwen_world.moe_layers) == full_bytes

    segments = [(5, ADAPTER), (7, None)]
    result = part.client.forward(last, qwen_world.inputs[last], segments)
    assert_close(result.output, qwen_world.expected(last, [(5, ADAPTER), (7, None)]))

    # The host cache holds the adapter packed for the served layer only.
    full.client.forward(last, qwen_world.inputs[last], segments)
    part_size, full_size = (
        {a.name: a.size_bytes for a in running.client.list_loaded_adapters().adapters}[ADAPTER]
        for running in (part, full)
    )
    assert part_size * len(qwen_world.moe_layers) == full_size

    with pytest.raises(FailedPrecondition, match=f"serves layers {last} "):
        part.client.forward(first, qwen_world.inputs[first], segments)
    dense = qwen_world.dense_layers[0]
    with pytest.raises(InvalidArgument, match="is not a MoE layer"):
        part.client.forward(dense, qwen_world.inputs[last], segments)


def test_ranges_skip_dense_layers(qwen_world: World, start_executor: StartExecutor) -> None:
    """A range spanning a dense layer serves the MoE layers inside it."""
    every = f"0-{max(qwen_world.moe_layers)}"
    info = start_executor(qwen_world, layers=every).client.get_executor_info()
    assert list(info.served_layers) == list(qwen_world.moe_layers)


@pytest.mark.parametrize(
    ("layers", "message"),
    [("7", "beyond the model's 3 layers"), ("1", "holds no MoE layer")],
)
def test_bad_layers_stop_loading(
    qwen_world: World, start_executor: StartExecutor, layers: str, message: str
) -> None:
    assert qwen_world.dense_layers == (1,)
    running = start_executor(qwen_world, layers=layers, wait=False)
    assert running.app.loaded.wait(60)
    assert isinstance(running.app.load_error, InvalidArgument)
    assert message in str(running.app.load_error)
