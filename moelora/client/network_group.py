"""The two-rank torch.distributed process group of a network channel, made the same way on
both of its ends: rank 0 the executor's engine, rank 1 the client.

The group meets through the engine's ``TCPStore`` under the channel's ticket as key prefix (the
ticket is the one secret of the rendezvous: only the caller of ``OpenChannel`` learns it). It
carries one request's tensors at a time, in a fixed order: the input from the client, then
the output from the engine (``executor_service.serving.network_channels``).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol, cast

if TYPE_CHECKING:
    import torch
    from torch._C._distributed_c10d import Store, Work

#: The engine's rank and the client's.
ENGINE_RANK, CLIENT_RANK = 0, 1
#: How long a transfer or the rendezvous may take before the group gives up on its peer.
GROUP_TIMEOUT = datetime.timedelta(seconds=60)
#: The client's first transfer, which completes the rendezvous (NCCL makes its communicator).
HELLO_BYTES = 8
#: The tag of every transfer (one stream of them per group, in order).
TAG = 0


class Group(Protocol):
    """What a channel uses of its torch.distributed backend (NCCL's or Gloo's)."""

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Work: ...

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Work: ...

    def abort(self) -> None: ...


def backend_for(device: torch.device) -> str:
    """NCCL between GPUs, Gloo between CPUs."""
    return "nccl" if device.type == "cuda" else "gloo"


#: What a channel's NCCL group is made with where the process's environment does not say
#: otherwise. torch's default (3) tears the whole process down when its watchdog sees a
#: communicator error, and the end of a channel is one: a client's process would die with an
#: executor that restarts or ends its channel, the engine with a client that closes its own.
#: Here an error aborts that group's communicator alone, and no heartbeat monitor kills the
#: process over a watchdog stuck on a peer that is gone.
NCCL_GROUP_DEFAULTS = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    "TORCH_NCCL_ENABLE_MONITORING": "0",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
}
_ENVIRONMENT = threading.Lock()


@contextlib.contextmanager
def nccl_group_defaults() -> Iterator[None]:
    """``NCCL_GROUP_DEFAULTS`` in the environment, for the variables it lacks, while a group is
    made (torch reads them in the group's constructor), and gone after: the process's own
    groups keep torch's defaults, and an operator's settings win."""
    with _ENVIRONMENT:
        added = [name for name in NCCL_GROUP_DEFAULTS if name not in os.environ]
        for name in added:
            os.environ[name] = NCCL_GROUP_DEFAULTS[name]
        try:
            yield
        finally:
            for name in added:
                os.environ.pop(name, None)


def store_client(address: str, timeout: datetime.timedelta = GROUP_TIMEOUT) -> Store:
    """A client of the engine's rendezvous store at ``address`` ("host:port")."""
    from torch._C._distributed_c10d import TCPStore

    host, _, port = address.rpartition(":")
    return TCPStore(host.strip("[]"), int(port), is_master=False, timeout=timeout)


def channel_group(
    store: Store,
    ticket: str,
    rank: int,
    backend: str,
    timeout: datetime.timedelta = GROUP_TIMEOUT,
) -> Group:
    """The channel's group, its keys under ``ticket`` in ``store``. NCCL makes its
    communicator at the first transfer (both ends must be there)."""
    import torch.distributed as dist
    from torch._C._distributed_c10d import PrefixStore

    prefixed = PrefixStore(f"channel/{ticket}", store)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        with nccl_group_defaults():
            return cast(Group, dist.ProcessGroupNCCL(prefixed, rank, 2, options))
    if backend == "gloo":
        return cast(Group, dist.ProcessGroupGloo(prefixed, rank, 2, timeout))
    raise ValueError(f"backend: {backend!r} is not nccl or gloo")


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view (what the group moves)."""
    import torch

    return tensor.reshape(-1).view(torch.uint8)


def abort(group: Group) -> None:
    """Ends the group's transfers at once (a peer that is gone never completes them)."""
    # Gloo's abort may not be implemented: its sockets close with it.
    with contextlib.suppress(Exception):
        group.abort()
