"""A front end's side of the serving split: its connection to the engine.

Handler threads send a Forward descriptor (the tensors already in the front end's arena) or an
admin call and block until the engine answers; one reader thread receives the answers and wakes
each waiting handler. The engine also pushes its state (serving, or why not), which the front
end reports through health. If the engine goes away, every waiting and later call fails
UNAVAILABLE and ``on_gone`` runs (a front-end process then exits).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import socket
import threading
from collections.abc import Callable
from typing import Any

from executor_service.serving.arena import Arena
from moelora.client.engine_wire import (
    Connection,
    ForwardDescriptor,
    ForwardResult,
    Kind,
    raise_for,
)
from moelora.client.errors import Unavailable
from moelora.client.logs import log_event

log = logging.getLogger(__name__)

#: The engine says whether to serve, and why not.
StateListener = Callable[[bool, str], None]
#: The engine says a descriptor (by request id) waits for its adapters to load.
WaitingListener = Callable[[int], None]


class _Waiter:
    __slots__ = ("answer", "done")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.answer: ForwardResult | dict[str, Any] | None = None


class EngineLink:
    """The connection of one front end to the engine (see the module doc)."""

    def __init__(
        self,
        sock: socket.socket,
        arena: Arena,
        on_state: StateListener,
        on_gone: Callable[[], None] | None = None,
    ) -> None:
        self._connection = Connection(sock)
        self.arena = arena
        self._on_state = on_state
        self._on_gone = on_gone
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._waiting: dict[int, _Waiter] = {}
        self._gone = False
        self._closed = False
        self._on_waiting: WaitingListener | None = None

    def start(self) -> None:
        self._connection.send_json(Kind.HELLO, {"arena": self.arena.name, "pid": os.getpid()})
        threading.Thread(target=self._read, name="engine-link-reader", daemon=True).start()

    def listen_waiting(self, listener: WaitingListener) -> None:
        """``listener`` hears of each descriptor that waits for adapter loads (the combiner
        stops counting it as queued), on the reader thread: it must be quick."""
        self._on_waiting = listener

    def next_id(self) -> int:
        return next(self._ids)

    def forward(self, descriptor: ForwardDescriptor) -> ForwardResult:
        """Sends ``descriptor`` and waits for its result, however long the engine takes (it
        writes into the descriptor's output region until it answers)."""
        waiter = self._register(descriptor.request_id)
        self._send(Kind.FORWARD, descriptor.encode(), descriptor.request_id)
        waiter.done.wait()
        answer = waiter.answer
        if not isinstance(answer, ForwardResult):
            raise Unavailable("the executor's engine stopped; retry on another replica")
        return answer

    def call(self, method: str, args: dict[str, Any]) -> Any:
        """Runs an admin call in the engine; its value, or the domain error it raised."""
        call_id = self.next_id()
        waiter = self._register(call_id)
        payload = json.dumps({"id": call_id, "method": method, "args": args}).encode()
        self._send(Kind.CALL, payload, call_id)
        waiter.done.wait()
        reply = waiter.answer
        if not isinstance(reply, dict):
            raise Unavailable("the executor's engine stopped; retry on another replica")
        raise_for(reply["code"], reply["message"], reply.get("retry_after_ms") or 0)
        return reply["value"]

    def _register(self, key: int) -> _Waiter:
        waiter = _Waiter()
        with self._lock:
            if self._gone:
                raise Unavailable("the executor's engine stopped; retry on another replica")
            self._waiting[key] = waiter
        return waiter

    def _send(self, kind: Kind, payload: bytes, key: int) -> None:
        try:
            self._connection.send(kind, payload)
        except OSError:
            with self._lock:
                self._waiting.pop(key, None)
            raise Unavailable("the executor's engine stopped; retry on another replica") from None

    def _read(self) -> None:
        try:
            while True:
                kind, payload = self._connection.recv()
                if kind is Kind.RESULT:
                    result = ForwardResult.decode(payload)
                    self._wake(result.request_id, result)
                elif kind is Kind.REPLY:
                    reply = json.loads(payload)
                    self._wake(int(reply["id"]), reply)
                elif kind is Kind.WAITING:
                    if self._on_waiting is not None:
                        self._on_waiting(int.from_bytes(payload[:8], "little"))
                elif kind is Kind.STATE:
                    state = json.loads(payload)
                    self._on_state(bool(state["serving"]), str(state["reason"]))
        except (EOFError, OSError):
            pass
        except Exception:
            log_event(log, "engine_link_broken", logging.ERROR, exc_info=True)
        self._lost()

    def _wake(self, key: int, answer: ForwardResult | dict[str, Any]) -> None:
        with self._lock:
            waiter = self._waiting.pop(key, None)
        if waiter is not None:
            waiter.answer = answer
            waiter.done.set()

    def _lost(self) -> None:
        with self._lock:
            self._gone = True
            waiting, self._waiting = self._waiting, {}
        for waiter in waiting.values():
            waiter.done.set()
        if self._closed:  # this side hung up (a drained front end): the engine is not gone
            return
        self._on_state(False, "the executor's engine stopped")
        if self._on_gone is not None:
            self._on_gone()

    @property
    def gone(self) -> bool:
        return self._gone

    def close(self) -> None:
        self._closed = True
        self._connection.close()
