"""A front end's waiting Forward requests travel to the engine combined (``serving.combiner``):
driven here as a front end drives it, over the engine's real socket and a real arena, against
the float32 references of the qwen3_moe world."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch

from executor_service.serving.arena import Arena, Region
from executor_service.serving.combiner import CombineLimits, Combiner, combinable
from executor_service.serving.engine_link import EngineLink
from executor_service.sources import LocalFolderSource
from moelora.client.engine_wire import ForwardDescriptor, ForwardResult, TensorRef
from moelora.v1 import tensor_pb2
from tests.executor.conftest import (
    FOREIGN,
    GatedSource,
    Running,
    StartExecutor,
    assert_close,
    slowed_kernel,
)
from tests.executor.worlds import TOKENS, World

F32 = tensor_pb2.DATA_TYPE_FLOAT32
OK = 0
LIMITS = CombineLimits(combine_after=1, max_tokens=512, max_adapters=8)


@dataclass
class FrontEnd:
    """What a front end holds: a link to the engine, its arena and a combiner over them."""

    link: EngineLink
    arena: Arena
    combiner: Combiner
    running: Running

    def put(self, rows: torch.Tensor) -> tuple[TensorRef, TensorRef, list[Region]]:
        """``rows`` (float32) copied into the arena, and a region for the answer."""
        data = rows.contiguous().numpy().tobytes()
        into, out = self.arena.allocate(len(data)), self.arena.allocate(len(data))
        self.arena.view(into)[: len(data)] = data
        shape = tuple(rows.shape)
        return (
            TensorRef("", into.offset, len(data), F32, shape),
            TensorRef("", out.offset, len(data), F32, shape),
            [into, out],
        )

    def forward(
        self, layer: int, rows: torch.Tensor, segments: list[tuple[int, str]]
    ) -> tuple[ForwardResult, torch.Tensor]:
        hidden, output, regions = self.put(rows)
        try:
            descriptor = ForwardDescriptor(
                self.link.next_id(), layer, 5.0, 0.0, "", hidden, output, tuple(segments)
            )
            result = self.combiner.forward(descriptor)
            region = regions[1]
            answer = torch.frombuffer(
                bytearray(self.arena.view(region)[: output.nbytes]), dtype=torch.float32
            ).view(rows.shape)
            return result, answer
        finally:
            for region in regions:
                self.arena.free(region)

    def descriptors(self) -> float:
        """Descriptors the engine decoded (one ``decode`` stage each)."""
        return self.running.metric("moelora_executor_stage_seconds_count", stage="decode")

    def requests(self) -> float:
        return self.running.metric(
            "moelora_executor_forward_requests_by_transport_total", transport="message"
        )


@contextlib.contextmanager
def _attached(running: Running, path: Path, limits: CombineLimits = LIMITS) -> Iterator[FrontEnd]:
    """A front end's link, arena and combiner on ``running``'s engine (socket at ``path``)."""
    running.app.host.listen(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(path))
    arena = Arena.create("moelora-test-combiner", 16 * 1024**2)
    link = EngineLink(sock, arena, on_state=lambda _serving, _reason: None)
    link.start()
    try:
        yield FrontEnd(link, arena, Combiner(link, limits), running)
    finally:
        link.close()
        arena.close()


@pytest.fixture
def front_end(
    qwen_world: World, start_executor: StartExecutor, tmp_path: Path
) -> Iterator[FrontEnd]:
    # Each launch waits 0.3 s: requests sent meanwhile wait in the combiner, together.
    running = start_executor(qwen_world, kernel=slowed_kernel(0.3), num_slots=6)
    with _attached(running, tmp_path / "engine.sock") as attached:
        yield attached


Call = tuple[int, list[tuple[int, str]]]


def _together(
    front_end: FrontEnd, calls: list[Call], world: World, layers: list[int] | None = None
) -> list[tuple[ForwardResult, torch.Tensor]]:
    """A first request holds the engine; ``calls`` ((rows, segments), on ``layers`` or the
    first MoE layer) arrive meanwhile, so they wait to go combined. Their (result, answer)."""
    answers: list[tuple[ForwardResult, torch.Tensor] | None] = [None] * (len(calls) + 1)
    first_layer = world.moe_layers[0]
    layers = layers or [first_layer] * len(calls)

    def call(index: int, layer: int, segments: list[tuple[int, str]], rows: int) -> None:
        answers[index] = front_end.forward(layer, world.inputs[layer][:rows], segments)

    first = threading.Thread(target=call, args=(0, first_layer, [(TOKENS, "")], TOKENS))
    first.start()
    time.sleep(0.1)  # the first is in the engine, its kernel sleeping
    threads = []
    for i, ((tokens, segments), layer) in enumerate(zip(calls, layers, strict=True), start=1):
        threads.append(threading.Thread(target=call, args=(i, layer, segments, tokens)))
        threads[-1].start()
    for thread in [first, *threads]:
        thread.join(60)
    done = [a for a in answers[1:] if a is not None]
    assert len(done) == len(calls) and answers[0] is not None
    return done


def test_requests_that_wait_go_as_one_descriptor_and_each_gets_its_own_answer(
    qwen_world: World, front_end: FrontEnd
) -> None:
    layer = qwen_world.moe_layers[0]
    calls = [
        (TOKENS, [(3, "alpha"), (TOKENS - 3, "")]),
        (TOKENS, []),
        (5, [(2, "beta"), (3, "alpha")]),
        (TOKENS, [(TOKENS, "gamma")]),
    ]
    answers = _together(front_end, calls, qwen_world)
    for (tokens, segments), (result, rows) in zip(calls, answers, strict=True):
        assert result.code == OK, result.message
        spelled = segments or [(tokens, "")]
        expected = qwen_world.expected(layer, [(n, a or None) for n, a in spelled])
        assert_close(rows, expected[:tokens])
        assert [a.split(":")[0] for a in result.resolved_adapters] == [a for _, a in spelled]
    # The first alone, the four others as one: five requests in two descriptors.
    assert front_end.requests() == 5
    assert front_end.descriptors() == 2


def test_each_member_learns_only_the_loads_of_its_own_adapters(
    qwen_world: World, front_end: FrontEnd
) -> None:
    calls = [(TOKENS, [(TOKENS, "delta")]), (TOKENS, []), (4, [(4, "eps")])]
    answers = _together(front_end, calls, qwen_world)
    results = [result for result, _ in answers]
    assert [r.code for r in results] == [OK] * 3
    assert results[0].adapters_loaded == 1 and results[0].loaded_adapters == ("delta:1",)
    assert results[1].adapters_loaded == 0 and results[1].loaded_adapters == ()
    assert results[2].adapters_loaded == 1 and results[2].loaded_adapters == ("eps:1",)
    assert front_end.descriptors() == 2


def test_a_bad_request_among_combined_ones_fails_alone_with_its_own_error(
    qwen_world: World, front_end: FrontEnd
) -> None:
    """The combined descriptor fails; each member is then sent alone, so the unknown adapter
    is its sender's NOT_FOUND and the others are answered right."""
    layer = qwen_world.moe_layers[0]
    calls = [
        (TOKENS, [(TOKENS, "alpha")]),
        (TOKENS, [(2, ""), (TOKENS - 2, "no-such-adapter")]),
        (TOKENS, [(TOKENS, FOREIGN)]),
        (TOKENS, []),
    ]
    answers = _together(front_end, calls, qwen_world)
    results = [result for result, _ in answers]
    assert results[1].code == grpc.StatusCode.NOT_FOUND.value[0]
    assert "'no-such-adapter' not found" in results[1].message
    assert results[2].code == grpc.StatusCode.FAILED_PRECONDITION.value[0], results[2]
    assert FOREIGN in results[2].message
    for index in (0, 3):
        assert results[index].code == OK, results[index].message
    expected_alpha = qwen_world.expected(layer, [(TOKENS, "alpha")])
    assert_close(answers[0][1], expected_alpha)
    assert_close(answers[3][1], qwen_world.expected(layer, [(TOKENS, None)]))
    # The first alone, the four combined, then each of the four alone.
    assert front_end.descriptors() == 6
    assert front_end.requests() == 1 + 4 + 4


def test_requests_that_cannot_share_a_launch_are_not_combined(
    qwen_world: World, front_end: FrontEnd
) -> None:
    """Another layer, or past the rows' limit: separate descriptors, each answered right."""
    first, second = qwen_world.moe_layers[0], qwen_world.moe_layers[-1]
    assert first != second
    front_end.combiner = Combiner(front_end.link, CombineLimits(1, TOKENS + 2, max_adapters=8))
    calls: list[Call] = [
        (TOKENS, [(TOKENS, "alpha")]),
        (TOKENS, [(TOKENS, "beta")]),
        (TOKENS, [(TOKENS, "alpha")]),
        (2, [(2, "beta")]),
    ]
    layers = [first, first, second, first]
    answers = _together(front_end, calls, qwen_world, layers)
    for (tokens, segments), layer, (result, rows) in zip(calls, layers, answers, strict=True):
        assert result.code == OK, result.message
        expected = qwen_world.expected(layer, [(n, a) for n, a in segments])
        assert_close(rows, expected[:tokens])
    # The first alone; then the first call with the last (TOKENS + 2 rows at most), the
    # second alone, the third (another layer) alone.
    assert front_end.descriptors() == 4
    assert front_end.requests() == 5


def test_a_request_waiting_for_its_adapter_holds_back_no_request_behind_it(
    qwen_world: World, start_executor: StartExecutor, tmp_path: Path
) -> None:
    """With one descriptor allowed queued, a request whose adapter's fetch is held (the engine
    says WAITING) no longer counts: the next one is sent and answered meanwhile."""
    gate = threading.Event()
    source = GatedSource(LocalFolderSource(qwen_world.adapter_dir), gate)
    running = start_executor(qwen_world, source=source)
    layer = qwen_world.moe_layers[0]
    with _attached(running, tmp_path / "engine.sock") as front_end:
        loading: list[tuple[ForwardResult, torch.Tensor]] = []
        first = threading.Thread(
            target=lambda: loading.append(
                front_end.forward(layer, qwen_world.inputs[layer], [(TOKENS, "alpha")])
            )
        )
        first.start()
        deadline = time.monotonic() + 30
        while not source.fetches and time.monotonic() < deadline:
            time.sleep(0.01)
        result, rows = front_end.forward(layer, qwen_world.inputs[layer], [])
        assert result.code == OK, result.message
        assert_close(rows, qwen_world.expected(layer, [(TOKENS, None)]))
        assert not loading, "the loading request was answered before its fetch could end"
        gate.set()
        first.join(30)
        assert loading and loading[0][0].code == OK
        assert_close(loading[0][1], qwen_world.expected(layer, [(TOKENS, "alpha")]))


def test_only_whole_well_formed_arena_requests_are_combined() -> None:
    rows = TensorRef("", 0, 4 * 8 * 16, F32, (8, 16))

    def descriptor(**changes: object) -> ForwardDescriptor:
        fields: dict[str, object] = {
            "request_id": 1, "layer": 1, "slot_wait": 1.0, "decode_seconds": 0.0, "scope": "",
            "hidden": rows, "output": rows, "segments": ((3, "a"), (5, "")),
        }  # fmt: skip
        fields.update(changes)
        return ForwardDescriptor(**fields)  # type: ignore[arg-type]

    assert combinable(descriptor())
    assert combinable(descriptor(segments=()))
    assert not combinable(descriptor(segments=((3, "a"), (6, ""))))  # rows miscounted
    assert not combinable(descriptor(segments=((0, "a"), (8, ""))))
    assert not combinable(descriptor(hidden=TensorRef("ring", 0, 512, F32, (8, 16))))
    assert not combinable(descriptor(hidden=TensorRef("", 0, 512, F32, (2, 4, 16))))
    assert not combinable(descriptor(requests=2))
    ids = TensorRef("", 0, 64, tensor_pb2.DATA_TYPE_INT32, (8, 2))
    assert combinable(descriptor(topk_ids=ids, topk_weights=ids))
    assert not combinable(descriptor(topk_ids=ids))
    short = TensorRef("", 0, 56, tensor_pb2.DATA_TYPE_INT32, (7, 2))
    assert not combinable(descriptor(topk_ids=short, topk_weights=ids))


@pytest.mark.parametrize("requests", [0, TOKENS + 1])
def test_the_engine_refuses_a_descriptor_that_claims_too_many_or_no_requests(
    qwen_world: World, front_end: FrontEnd, requests: int
) -> None:
    layer = qwen_world.moe_layers[0]
    hidden, output, _ = front_end.put(qwen_world.inputs[layer])
    result = front_end.link.forward(
        ForwardDescriptor(
            front_end.link.next_id(), layer, 1.0, 0.0, "", hidden, output, (), requests=requests
        )
    )
    assert result.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert result.message.startswith("requests:")
