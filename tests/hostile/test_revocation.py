"""A token removed from the token file ends its open streams: a ForwardStream that keeps sending
requests and a WatchAdapters stream end with UNAUTHENTICATED within a few seconds of the file's
change, and no request sent after that is computed."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator

import grpc

from moelora.client.auth import bearer_metadata
from moelora.client.executor import forward_request
from moelora.v1 import executor_pb2, executor_pb2_grpc, registry_pb2, registry_pb2_grpc
from shared.call_limits import RECHECK_SECONDS
from shared.tokens import Role, new_token_entry
from tests.hostile.conftest import Tokens
from tests.live_stack import Stack

#: The token file is looked at every 2 s (shared.tokens), open streams re-checked every second.
ENDS_WITHIN_SECONDS = 2.0 + RECHECK_SECONDS + 1.5


def test_revoking_a_token_ends_its_streams(authed_stack: Stack, hostile_tokens: Tokens) -> None:
    token, entry = new_token_entry("revocable", Role.READ)
    hostile_tokens.entries.append(entry)
    hostile_tokens.restore()
    time.sleep(2.5)  # the servers see the new token
    metadata = bearer_metadata(token)
    layer = authed_stack.world.moe_layers[0]
    hidden = authed_stack.world.inputs[layer][:4]
    stop = threading.Event()
    sent: queue.Queue[tuple[int, float]] = queue.Queue()

    def requests() -> Iterator[executor_pb2.ForwardStreamRequest]:
        request_id = 0
        while not stop.is_set():
            request_id += 1
            sent.put((request_id, time.monotonic()))
            yield executor_pb2.ForwardStreamRequest(
                request_id=request_id, forward=forward_request(layer, hidden, [(4, "alpha")])
            )
            time.sleep(0.1)

    with (
        grpc.insecure_channel(authed_stack.executor_address) as executor,
        grpc.insecure_channel(authed_stack.registry_address) as registry,
    ):
        stream = executor_pb2_grpc.ExecutorStub(executor).ForwardStream(
            requests(), metadata=metadata, timeout=60
        )
        watch = registry_pb2_grpc.AdapterRegistryStub(registry).WatchAdapters(
            registry_pb2.WatchAdaptersRequest(), metadata=metadata, timeout=60
        )
        answered = [next(stream) for _ in range(5)]
        assert all(a.HasField("forward") for a in answered)
        revoked_at = time.monotonic()
        hostile_tokens.entries.remove(entry)
        hostile_tokens.restore()
        answers_after: list[float] = []
        try:
            for _ in stream:
                answers_after.append(time.monotonic() - revoked_at)
            stream_code = "OK"
        except grpc.RpcError as exc:
            stream_code = exc.code().name
        stream_end = time.monotonic() - revoked_at
        try:
            list(watch)
            watch_code = "OK"
        except grpc.RpcError as exc:
            watch_code = exc.code().name
        watch_end = time.monotonic() - revoked_at
        stop.set()
    print(f"\nrevoked: ForwardStream {stream_code} after {stream_end:.1f} s "
          f"({len(answers_after)} answers after the revocation), "
          f"WatchAdapters {watch_code} after {watch_end:.1f} s")  # fmt: skip
    assert stream_code == "UNAUTHENTICATED" and watch_code == "UNAUTHENTICATED"
    assert stream_end < ENDS_WITHIN_SECONDS and watch_end < ENDS_WITHIN_SECONDS
    # Requests go every 0.1 s: the ones answered are those before the servers saw the change.
    assert all(t < ENDS_WITHIN_SECONDS for t in answers_after)
