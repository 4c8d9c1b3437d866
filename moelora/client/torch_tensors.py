"""Tensors on the wire <-> torch tensors (the executor's side of ``moelora.client.tensors``).

Apart from ``moelora.client.tensors`` so that the registry, which has no torch, imports none.
Decoding views the message's bytes (read-only, zero-copy); encoding copies once.
"""

from __future__ import annotations

import warnings

import torch

from moelora.client.tensors import WIRE_TYPES, checked_shape, dtype_from_name
from moelora.v1 import tensor_pb2


def to_torch(
    message: tensor_pb2.Tensor, field: str = "tensor", device: str | torch.device | None = None
) -> torch.Tensor:
    """Decodes to a torch tensor. Without ``device`` the result views the message's
    bytes (read-only: copy before writing); with one it is copied there once."""
    shape, wire = checked_shape(message, field)
    dtype = getattr(torch, wire.torch)
    if not message.data:
        result = torch.empty(shape, dtype=dtype)
    else:
        with warnings.catch_warnings():
            # The view is read-only by design; torch warns about every such buffer.
            warnings.filterwarnings("ignore", message=".*not writable.*")
            flat = torch.frombuffer(message.data, dtype=torch.uint8)
        result = flat.view(dtype).reshape(shape)
    return result if device is None else result.to(device)


def from_torch(tensor: torch.Tensor) -> tensor_pb2.Tensor:
    """Encodes a torch tensor from any device, dtype included bfloat16."""
    name = str(tensor.dtype).removeprefix("torch.")
    code = dtype_from_name(name)
    wire = WIRE_TYPES[code]
    host = tensor.detach().to("cpu").contiguous()
    raw = host.view(-1).view(_BYTE_VIEW_DTYPES[wire.itemsize]).numpy()
    return tensor_pb2.Tensor(dtype=code, shape=list(tensor.shape), data=raw.tobytes())


#: An integer dtype of each item size, to reinterpret any tensor's bytes for numpy.
_BYTE_VIEW_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
