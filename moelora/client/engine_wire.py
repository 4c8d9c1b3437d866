"""What the executor's engine says over its local sockets: to its gRPC front ends, and to
same-host clients' direct channels (``moelora.client.channel``).

Frames are a 4-byte length, a 1-byte kind and a payload. Forward requests and their results
(the hot path) are packed structs that point at tensors in shared or CUDA memory; the rest (a
peer introducing itself, admin calls, the engine's state) is JSON. No protobuf and no pickling.
All integers little-endian; a string is a u16 length and UTF-8 bytes.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
import threading
from dataclasses import dataclass
from enum import IntEnum

import grpc

from moelora.client.errors import Overloaded, error_for_code

#: A frame's head: the payload's length and the kind.
FRAME_HEAD = struct.Struct("<IB")
#: A frame's payload is at most this long (descriptors and admin answers are small).
MAX_FRAME = 64 * 1024 * 1024


class Kind(IntEnum):
    HELLO = 1  # peer -> engine, JSON: {"arena": name, "pid": n} or {"ticket": t, "pid": n}
    FORWARD = 2  # front end -> engine: ForwardDescriptor
    RESULT = 3  # engine -> front end: ForwardResult
    CALL = 4  # front end -> engine, JSON: {"id": n, "method": str, "args": {...}}
    REPLY = 5  # engine -> front end, JSON: {"id": n, "code": int, "message": str, "value": ...}
    STATE = 6  # engine -> front end, JSON: {"serving": bool, "reason": str}
    WAITING = 7  # engine -> front end: u64 request id of a descriptor waiting for adapter loads
    BELL = 8  # channel -> engine, empty: a request is in the spin block (``spin_block``)


@dataclass(frozen=True)
class TensorRef:
    """A tensor in shared memory: ``segment`` at ``offset`` ("" = the front end's arena,
    else the name of a region the caller registered)."""

    segment: str
    offset: int
    nbytes: int
    #: A ``tensor_pb2.DataType`` value.
    dtype: int
    shape: tuple[int, ...]


_REF = struct.Struct("<QQIB")  # offset, nbytes, dtype, ndim


def _pack_str(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<H", len(raw)) + raw


#: The shape of a tensor of n dimensions (the common ones, made once).
_SHAPES = {n: struct.Struct(f"<{n}q") for n in range(9)}


def _string_at(data: bytes | memoryview, at: int) -> tuple[str, int]:
    """The string at ``at`` and the offset after it."""
    (length,) = _U16.unpack_from(data, at)
    at += 2
    if at + length > len(data):
        raise ValueError("a string runs past the end of the frame")
    return str(data[at : at + length], "utf-8"), at + length


def _ref_at(data: bytes | memoryview, at: int) -> tuple[TensorRef, int]:
    """The tensor reference at ``at`` and the offset after it."""
    segment, at = _string_at(data, at)
    offset, nbytes, dtype, ndim = _REF.unpack_from(data, at)
    at += _REF.size
    shape = (_SHAPES.get(ndim) or struct.Struct(f"<{ndim}q")).unpack_from(data, at)
    return TensorRef(segment, offset, nbytes, dtype, shape), at + 8 * ndim


_U16 = struct.Struct("<H")


def _pack_ref(ref: TensorRef) -> bytes:
    return (
        _pack_str(ref.segment)
        + _REF.pack(ref.offset, ref.nbytes, ref.dtype, len(ref.shape))
        + struct.pack(f"<{len(ref.shape)}q", *ref.shape)
    )


@dataclass(frozen=True)
class ForwardDescriptor:
    """One Forward request, its tensors in shared memory."""

    request_id: int
    layer: int
    #: Seconds the request may wait for GPU slots (its deadline's share).
    slot_wait: float
    #: What the front end spent on the request before sending it (the decode stage).
    decode_seconds: float
    #: Whose shared-memory regions ``TensorRef.segment`` names (the caller's token scope).
    scope: str
    hidden: TensorRef
    output: TensorRef
    #: (num_tokens, adapter reference or "" for the base model).
    segments: tuple[tuple[int, str], ...]
    topk_ids: TensorRef | None = None
    topk_weights: TensorRef | None = None
    #: Client requests whose rows these are, one after the other (a front end combines
    #: requests that wait: ``executor_service.serving.combiner``); counted by the engine.
    requests: int = 1

    def encode(self) -> bytes:
        parts = [
            _HEAD.pack(
                self.request_id,
                self.layer,
                self.slot_wait,
                self.decode_seconds,
                self._flags(),
                self.requests,
            ),
            _pack_str(self.scope),
            _pack_ref(self.hidden),
            _pack_ref(self.output),
        ]
        if self.topk_ids is not None and self.topk_weights is not None:
            parts += [_pack_ref(self.topk_ids), _pack_ref(self.topk_weights)]
        parts.append(struct.pack("<I", len(self.segments)))
        for tokens, adapter in self.segments:
            parts += [struct.pack("<I", tokens), _pack_str(adapter)]
        return b"".join(parts)

    def _flags(self) -> int:
        return 1 if self.topk_ids is not None else 0

    @staticmethod
    def peek_id(data: bytes | memoryview) -> int:
        """The request id of an encoded descriptor (0 if too short to hold one)."""
        return int.from_bytes(data[:8], "little") if len(data) >= 8 else 0

    @classmethod
    def decode(cls, data: bytes | memoryview) -> ForwardDescriptor:
        # Offsets threaded through plain functions: this runs on the launch loop per request.
        request_id, layer, slot_wait, decode_seconds, flags, requests = _HEAD.unpack_from(data, 0)
        scope, at = _string_at(data, _HEAD.size)
        hidden, at = _ref_at(data, at)
        output, at = _ref_at(data, at)
        ids = weights = None
        if flags & 1:
            ids, at = _ref_at(data, at)
            weights, at = _ref_at(data, at)
        (count,) = _U32.unpack_from(data, at)
        at += 4
        segments = []
        for _ in range(count):
            (tokens,) = _U32.unpack_from(data, at)
            adapter, at = _string_at(data, at + 4)
            segments.append((tokens, adapter))
        return cls(
            request_id, layer, slot_wait, decode_seconds, scope, hidden, output, tuple(segments),
            ids, weights, requests,
        )  # fmt: skip


_HEAD = struct.Struct("<QIddBH")
_U32 = struct.Struct("<I")
_RESULT = struct.Struct("<QBIIHI")  # id, code, retry_after_ms, server_time_us, loaded, n


@dataclass(frozen=True)
class ForwardResult:
    """The engine's answer: a status (``grpc.StatusCode`` value, 0 = OK) and, when OK, the
    output written where the descriptor said."""

    request_id: int
    code: int
    message: str = ""
    resolved_adapters: tuple[str, ...] = ()
    adapters_loaded: int = 0
    server_time_us: int = 0
    retry_after_ms: int = 0
    #: Which of ``resolved_adapters`` the request's launch loaded into GPU slots.
    loaded_adapters: tuple[str, ...] = ()

    def encode(self) -> bytes:
        head = _RESULT.pack(
            self.request_id,
            self.code,
            self.retry_after_ms,
            self.server_time_us,
            self.adapters_loaded,
            len(self.resolved_adapters),
        )
        names = b"".join(_pack_str(a) for a in self.resolved_adapters)
        loaded = b"".join(_pack_str(a) for a in self.loaded_adapters)
        count = _U16.pack(len(self.loaded_adapters))
        return head + names + _pack_str(self.message[:4096]) + count + loaded

    @classmethod
    def decode(cls, data: bytes | memoryview) -> ForwardResult:
        request_id, code, retry, server_us, loaded, count = _RESULT.unpack_from(data, 0)
        at = _RESULT.size
        names = []
        for _ in range(count):
            name, at = _string_at(data, at)
            names.append(name)
        message, at = _string_at(data, at)
        (count,) = _U16.unpack_from(data, at)
        at += 2
        loaded_names = []
        for _ in range(count):
            name, at = _string_at(data, at)
            loaded_names.append(name)
        return cls(
            request_id, code, message, tuple(names), loaded, server_us, retry, tuple(loaded_names)
        )


def frame(kind: Kind, payload: bytes) -> bytes:
    return FRAME_HEAD.pack(len(payload), kind) + payload


class Connection:
    """One end of the front end ↔ engine socket: whole frames, sends from any thread."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._send_lock = threading.Lock()

    def send(self, kind: Kind, payload: bytes) -> None:
        with self._send_lock:
            self.sock.sendall(frame(kind, payload))

    def send_frames(self, frames: list[bytes]) -> None:
        """Whole frames (``frame``) in one write."""
        with self._send_lock:
            self.sock.sendall(b"".join(frames))

    def send_json(self, kind: Kind, value: object) -> None:
        self.send(kind, json.dumps(value).encode())

    def send_fd(self, kind: Kind, payload: bytes, fd: int) -> None:
        """A frame with a file descriptor attached (a Unix socket's SCM_RIGHTS)."""
        with self._send_lock:
            data = frame(kind, payload)
            sent = socket.send_fds(self.sock, [data], [fd])
            self.sock.sendall(data[sent:])

    def recv_fd(self, max_frame: int = MAX_FRAME) -> tuple[Kind, bytes, int | None]:
        """The next frame and the file descriptor sent with it (``send_fd``), if any."""
        head, fds, _flags, _addr = socket.recv_fds(self.sock, FRAME_HEAD.size, 1)
        if not head:
            raise EOFError("the other end closed the connection")
        fd = fds[0] if fds else None
        try:
            length, kind = FRAME_HEAD.unpack(head + self._exact(FRAME_HEAD.size - len(head)))
            if length > max_frame:
                raise ValueError(f"frame of {length} bytes (at most {max_frame})")
            return Kind(kind), self._exact(length), fd
        except BaseException:
            if fd is not None:
                os.close(fd)
            raise

    def recv(self, max_frame: int = MAX_FRAME) -> tuple[Kind, bytes]:
        """The next frame; EOFError once the other end is gone, ValueError for a frame
        longer than ``max_frame`` (before reading it) or of an unknown kind."""
        length, kind = FRAME_HEAD.unpack(self._exact(FRAME_HEAD.size))
        if length > max_frame:
            raise ValueError(f"frame of {length} bytes (at most {max_frame})")
        return Kind(kind), self._exact(length)

    def _exact(self, count: int) -> bytes:
        chunks = []
        while count:
            chunk = self.sock.recv(count)
            if not chunk:
                raise EOFError("the other end closed the connection")
            chunks.append(chunk)
            count -= len(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        with contextlib.suppress(OSError):  # already gone
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


_CODES = {code.value[0]: code for code in grpc.StatusCode}


def raise_for(code: int, message: str, retry_after_ms: int = 0) -> None:
    """Raises the domain error the engine's status stands for (nothing for OK)."""
    if code == 0:
        return
    status = _CODES.get(code, grpc.StatusCode.UNKNOWN)
    if status is grpc.StatusCode.RESOURCE_EXHAUSTED and retry_after_ms > 0:
        raise Overloaded(message, retry_after_ms)
    raise error_for_code(status, message)
