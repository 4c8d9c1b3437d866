"""The pieces front ends and the engine share: shared-memory segments, a front end's arena
allocator, and the frames they exchange."""

from __future__ import annotations

import os
import random
import socket
import struct
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from executor_service.serving.arena import ALIGN, Arena, ArenaFull, Region
from executor_service.serving.engine_host import EngineHost
from moelora.client.engine_wire import (
    Connection,
    ForwardDescriptor,
    ForwardResult,
    Kind,
    TensorRef,
)
from moelora.client.shared_memory import SHM_ROOT, Segment


def test_a_segment_is_shared_by_name_and_its_creator_unlinks_it() -> None:
    owner = Segment.create_unique("moelora-test", 8192)
    other = Segment(owner.name)
    owner.buffer[100:105] = b"hello"
    assert bytes(other.buffer[100:105]) == b"hello" and other.size == 8192
    other.close()
    assert (SHM_ROOT / owner.name).exists(), "an attached process must not unlink it"
    owner.close()
    assert not (SHM_ROOT / owner.name).exists()
    with pytest.raises(ValueError):
        Segment("../etc/passwd")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 5000)), min_size=1, max_size=80))
def test_the_arena_never_hands_out_overlapping_regions_and_coalesces(
    steps: list[tuple[bool, int]],
) -> None:
    arena = Arena.create("moelora-test", 64 * 1024)
    try:
        held: list[tuple[int, int]] = []
        rng = random.Random(len(steps))
        for allocate, size in steps:
            if allocate or not held:
                try:
                    region = arena.allocate(size)
                except ArenaFull:
                    continue
                assert region.offset % ALIGN == 0 and region.nbytes >= size
                assert region.offset + region.nbytes <= arena.size
                for start, nbytes in held:
                    assert region.offset >= start + nbytes or region.offset + region.nbytes <= start
                held.append((region.offset, region.nbytes))
            else:
                offset, nbytes = held.pop(rng.randrange(len(held)))
                arena.free(Region(offset, nbytes))
        for offset, nbytes in held:
            arena.free(Region(offset, nbytes))
        assert arena.used == 0
        assert arena.allocate(arena.size).nbytes == arena.size, "free space did not coalesce"
    finally:
        arena.close()


def test_descriptors_and_results_survive_the_wire() -> None:
    hidden = TensorRef("", 4096, 2 * 7 * 64, 3, (7, 64))
    output = TensorRef("", 8192, 2 * 7 * 64, 3, (7, 64))
    ids = TensorRef("client-ring", 0, 7 * 2 * 4, 5, (7, 2))
    weights = TensorRef("client-ring", 256, 7 * 2 * 4, 1, (7, 2))
    descriptor = ForwardDescriptor(
        9, 3, 4.5, 0.25, "scope", hidden, output, ((3, "sql@prod"), (4, "")), ids, weights
    )
    assert ForwardDescriptor.decode(descriptor.encode()) == descriptor
    plain = ForwardDescriptor(10, 0, 1.0, 0.0, "", hidden, output, ((7, "é-adapter:2"),))
    assert ForwardDescriptor.decode(plain.encode()) == plain
    combined = ForwardDescriptor(11, 0, 1.0, 0.0, "", hidden, output, ((3, ""), (4, "")), None,
                                 None, requests=2)  # fmt: skip
    assert ForwardDescriptor.decode(combined.encode()) == combined
    result = ForwardResult(9, 8, "busy", ("sql:3", ""), 1, 1234, 50)
    assert ForwardResult.decode(result.encode()) == result
    loaded = ForwardResult(9, 0, "", ("sql:3", "", "chat:1"), 2, 77, 0, ("chat:1", "sql:3"))
    assert ForwardResult.decode(loaded.encode()) == loaded


def test_an_arena_takes_its_pages_before_handing_them_out() -> None:
    """Its pages are populated as it grows: a /dev/shm that cannot give them (here: the
    object cut short under the arena, as a full tmpfs would refuse them) is ArenaFull for the
    request that grows it, where a first write would have raised SIGBUS."""
    arena = Arena.create("moelora-test", 1 << 20)
    try:
        region = arena.allocate(1000)
        assert arena.reserved == arena.size  # one step covers this small arena
        arena.view(region)[:4] = b"ok!!"
    finally:
        arena.close()
    short = Arena.create("moelora-test", 1 << 20)
    try:
        os.truncate(SHM_ROOT / short.name, 4096)
        with pytest.raises(ArenaFull, match="no room"):
            short.allocate(1000)
        assert short.used == 0 and short.reserved == 0
    finally:
        short.close()


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_a_damaged_descriptor_fails_to_parse_and_never_otherwise(data: st.DataObject) -> None:
    """A channel's client writes descriptors: cut or overwritten anywhere, one parses to some
    descriptor or fails with the errors the engine answers INVALID_ARGUMENT for."""
    hidden = TensorRef("", 4096, 2 * 7 * 64, 3, (7, 64))
    ids = TensorRef("ring", 0, 56, 5, (7, 2))
    whole = ForwardDescriptor(
        9, 3, 4.5, 0.25, "scope", hidden, hidden, ((3, "sql@prod"), (4, "")), ids, ids
    ).encode()
    cut = data.draw(st.integers(0, len(whole)))
    damaged = bytearray(whole[:cut])
    for _ in range(data.draw(st.integers(0, 3))):
        if damaged:
            damaged[data.draw(st.integers(0, len(damaged) - 1))] = data.draw(st.integers(0, 255))
    try:
        ForwardDescriptor.decode(bytes(damaged))
    except (struct.error, ValueError, UnicodeDecodeError):
        assert cut < len(whole) or damaged != bytearray(whole)


def test_frames_arrive_whole_and_a_closed_end_is_eof() -> None:
    left, right = socket.socketpair()
    a, b = Connection(left), Connection(right)
    big = bytes(range(256)) * 4096  # more than the socket buffers: sent in pieces

    def send() -> None:
        a.send(Kind.FORWARD, big)
        a.send_json(Kind.CALL, {"id": 1, "method": "list"})

    sender = threading.Thread(target=send)
    sender.start()
    assert b.recv() == (Kind.FORWARD, big)
    kind, payload = b.recv()
    assert kind is Kind.CALL and payload == b'{"id": 1, "method": "list"}'
    sender.join(10)
    a.close()
    with pytest.raises(EOFError):
        b.recv()
    b.close()


def test_the_engine_gives_up_a_front_end_that_stops_reading() -> None:
    """One thread answers every front end, so a front end that stops reading its answers is
    cut off after the send timeout instead of stalling the engine."""
    host = EngineHost(workers=1, send_timeout=0.2)
    engine_end, front_end = socket.socketpair()
    host.serve(engine_end)
    flooding = Connection(front_end)

    def flood() -> None:  # descriptors the engine answers at once (it has no model yet)
        request_id = 0
        try:
            while True:
                request_id += 1
                flooding.send(Kind.FORWARD, request_id.to_bytes(8, "little"))
        except OSError:
            pass  # the engine shut the connection

    sender = threading.Thread(target=flood, daemon=True)
    sender.start()
    sender.join(30)  # ends once the engine has given up on us (or the test fails below)
    assert not sender.is_alive(), "the engine kept waiting on a front end that never reads"
    front_end.settimeout(30)
    frames = 0
    try:
        while True:
            kind, _ = flooding.recv()
            assert kind in (Kind.STATE, Kind.RESULT)
            frames += 1
    except EOFError:
        pass
    assert frames > 0  # it answered until the socket's buffers were full
    host.close()
    flooding.close()
