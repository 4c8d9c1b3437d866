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

from typing import TYPE_CHECKING, cast

from moelora.client.cuda_ipc import DeviceBuffer, device_uuid
from moelora.client.shared_memory import Array, Slot, SlotPool, slot_request
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

        self.region = region
        self.hidden_size = hidden_size
        self.max_tokens = max_tokens
        self.device = torch.device(device)
        self.dtype_code = dtype_from_name(dtype)
        self.dtype: torch.dtype = getattr(torch, WIRE_TYPES[self.dtype_code].torch)
        area = max_tokens * hidden_size * self.dtype.itemsize
        self._slots = SlotPool(slots, max_tokens, hidden_size, area)
        self.buffer = DeviceBuffer(2 * slots * area, self.device)

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
        if getattr(hidden, "dtype", None) != self.dtype:
            return None
        return self._slots.take(tuple(int(d) for d in getattr(hidden, "shape", ())))

    def give_back(self, slot: Slot) -> None:
        self._slots.give_back(slot)

    def retire(self, slot: Slot) -> None:
        self._slots.retire(slot)

    def request(
        self, slot: Slot, hidden: torch.Tensor, layer: int, segments: list[executor_pb2.Segment]
    ) -> executor_pb2.ForwardRequest:
        """Copies ``hidden`` into ``slot``, waits for the copy (the executor reads it once the
        request arrives) and returns the Forward request naming it."""
        import torch

        self._view(slot.input_offset, slot.tokens).copy_(hidden.detach())
        torch.cuda.current_stream(self.device).synchronize()
        return slot_request(self.region, self.dtype_code, self.hidden_size, slot, layer, segments)

    def output(self, slot: Slot, like: Array) -> Array:
        """A copy of the output the executor wrote into ``slot`` (complete once it answered),
        on ``like``'s device (``like`` is a torch tensor: ``take`` took it)."""
        view = self._view(slot.output_offset, slot.tokens)
        return cast(Array, view.to(like.device, copy=True))

    def _view(self, offset: int, tokens: int) -> torch.Tensor:
        nbytes = tokens * self.hidden_size * self.dtype.itemsize
        return self.buffer.tensor[offset : offset + nbytes].view(self.dtype).view(tokens, -1)

    def close(self) -> None:
        """Frees the device memory (unregister it with the executor first)."""
        self.buffer.close()
