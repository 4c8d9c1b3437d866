"""Same-host CUDA memory: a ring of Forward slots in device memory that a client on the
executor's host registers once (``ExecutorClient.cuda_memory``).

With a ring, ``ExecutorClient.forward(..., ring=ring)`` copies the input (a torch tensor) into a
free slot on the client's GPU, waits for that copy, sends only descriptors (region, offset,
dtype, shape), and returns a copy of the output that the executor's kernels wrote into the same
slot: the tensors never leave the GPUs. A call that finds every slot busy, more tokens than a
slot holds or another dtype than the ring's sends its bytes in the message instead, so a ring
never fails a call that would work without it.

The RPC sequence for a client in another language: ``cudaMalloc`` a buffer,
``cudaIpcGetMemHandle`` it, ``RegisterCudaMemory{region, ipc_handle, device_uuid, size}`` once;
then per call write the input at some offset, synchronise the stream that wrote it, and send
``Forward`` with ``shared_hidden_states`` and ``shared_output`` naming (region, offset); the
output is in place when the answer arrives. ``UnregisterCudaMemory`` before freeing the buffer.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, cast

from moelora.client.cuda_ipc import DeviceBuffer, device_uuid
from moelora.client.shared_memory import Array, Slot
from moelora.client.tensors import WIRE_TYPES, dtype_from_name
from moelora.v1 import executor_pb2

if TYPE_CHECKING:
    import torch


class CudaMemoryRing:
    """``slots`` Forward slots of up to ``max_tokens`` × ``hidden_size`` values of ``dtype``
    (input and output each) in one ``cudaMalloc`` allocation on ``device``, registered with an
    executor as ``region``. Thread-safe: each call takes a free slot and gives it back."""

    def __init__(
        self,
        region: str,
        hidden_size: int,
        max_tokens: int,
        device: torch.device,
        slots: int = 4,
        dtype: str = "bfloat16",
    ) -> None:
        import torch

        if hidden_size < 1 or max_tokens < 1 or slots < 1:
            raise ValueError("hidden_size, max_tokens and slots must be at least 1")
        self.region = region
        self.hidden_size = hidden_size
        self.max_tokens = max_tokens
        self.device = torch.device(device)
        self.dtype_code = dtype_from_name(dtype)
        self.dtype: torch.dtype = getattr(torch, WIRE_TYPES[self.dtype_code].torch)
        self._area = max_tokens * hidden_size * self.dtype.itemsize
        self.buffer = DeviceBuffer(2 * slots * self._area, self.device)
        self._lock = threading.Lock()
        self._free = list(range(slots))

    def register_request(self) -> executor_pb2.RegisterCudaMemoryRequest:
        return executor_pb2.RegisterCudaMemoryRequest(
            region=self.region,
            ipc_handle=self.buffer.ipc_handle,
            device_uuid=device_uuid(self.device),
            size=self.buffer.nbytes,
        )

    def take(self, hidden: object) -> Slot | None:
        """A free slot that holds ``hidden`` (a (T, H) torch tensor of the ring's dtype), or
        None (the call then sends its bytes in the message)."""
        shape: tuple[int, ...] = tuple(getattr(hidden, "shape", ()))
        if getattr(hidden, "dtype", None) != self.dtype or len(shape) != 2:
            return None
        tokens = int(shape[0])
        if not 1 <= tokens <= self.max_tokens or int(shape[1]) != self.hidden_size:
            return None
        with self._lock:
            if not self._free:
                return None
            index = self._free.pop()
        start = 2 * index * self._area
        return Slot(index, tokens, start, start + self._area)

    def give_back(self, slot: Slot) -> None:
        with self._lock:
            self._free.append(slot.index)

    def request(
        self, slot: Slot, hidden: torch.Tensor, layer: int, segments: list[executor_pb2.Segment]
    ) -> executor_pb2.ForwardRequest:
        """Copies ``hidden`` into ``slot``, waits for the copy (the executor reads it once the
        request arrives) and returns the Forward request naming it."""
        import torch

        self._view(slot.input_offset, slot.tokens).copy_(hidden.detach())
        torch.cuda.current_stream(self.device).synchronize()
        shape = [slot.tokens, self.hidden_size]
        return executor_pb2.ForwardRequest(
            layer=layer,
            segments=segments,
            shared_hidden_states=executor_pb2.SharedTensor(
                region=self.region, offset=slot.input_offset, dtype=self.dtype_code, shape=shape
            ),
            shared_output=executor_pb2.SharedTensor(
                region=self.region, offset=slot.output_offset, dtype=self.dtype_code, shape=shape
            ),
        )

    def output(self, slot: Slot, like: Array) -> Array:
        """A copy of the output the executor wrote into ``slot`` (complete once it answered),
        on ``like``'s device (``like`` is a torch tensor: ``take`` took it)."""
        view = self._view(slot.output_offset, slot.tokens)
        return cast(Array, view.to(like.device, copy=True))

    def _view(self, offset: int, tokens: int) -> torch.Tensor:
        nbytes = tokens * self._area // self.max_tokens
        return self.buffer.tensor[offset : offset + nbytes].view(self.dtype).view(tokens, -1)

    def close(self) -> None:
        """Frees the device memory (unregister it with the executor first)."""
        self.buffer.close()
