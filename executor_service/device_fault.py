"""What the executor does when its GPU context is lost: stop looking healthy, tell every caller
to go elsewhere, and exit so that Kubernetes restarts it.

Some CUDA errors are sticky: after an illegal address, a launch failure, an uncorrectable ECC
error or a lost device, every later call on the context fails the same way, and only a new
process recovers. ``DeviceWatch`` is the executor's one record of such a fault. The first sticky
error seen anywhere (a launch, a slot write, a load) is reported once: logged with an error id,
counted, and handed to the listener (the app turns health NOT_SERVING and stops the process).
From then on every request fails fast with ``DeviceFaultError`` — UNAVAILABLE, naming the fault
— which clients and the cluster client take as "retry on another replica". Errors that are not
sticky stay the request's own; a CUDA out-of-memory becomes RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from executor_service.metrics import ExecutorMetrics
from moelora.client.errors import ResourceExhausted, Unavailable
from moelora.client.logs import log_event

log = logging.getLogger(__name__)

#: The process's exit status after a device fault (any non-zero restarts the pod; this one
#: says why in `kubectl describe`'s last state).
DEVICE_FAULT_EXIT_CODE = 3

#: cudaError_t values after which the context is unusable (CUDA runtime API, "sticky" errors).
STICKY_CUDA_ERRORS = frozenset(
    {
        214,  # cudaErrorECCUncorrectable
        220,  # cudaErrorNvlinkUncorrectable
        700,  # cudaErrorIllegalAddress
        702,  # cudaErrorLaunchTimeout
        710,  # cudaErrorAssert
        714,  # cudaErrorHardwareStackError
        715,  # cudaErrorIllegalInstruction
        716,  # cudaErrorMisalignedAddress
        717,  # cudaErrorInvalidAddressSpace
        718,  # cudaErrorInvalidPc
        719,  # cudaErrorLaunchFailure
        46,  # cudaErrorDevicesUnavailable
        999,  # cudaErrorUnknown (what a device that fell off the bus gives)
    }
)

#: The same errors as CUDA's, Triton's and the driver's messages say them (Triton's launcher
#: raises a plain RuntimeError "Triton Error [CUDA]: <the driver's message>").
STICKY_MESSAGES = (
    "an illegal memory access was encountered",
    "unspecified launch failure",
    "uncorrectable ecc error",
    "uncorrectable nvlink error",
    "device-side assert triggered",
    "an illegal instruction was encountered",
    "misaligned address",
    "invalid program counter",
    "hardware stack error",
    "the launch timed out and was terminated",
    "operation not supported on global/shared address space",
    "cuda-capable device(s) is/are busy or unavailable",
    "gpu has fallen off the bus",
    "cuda error: unknown error",
)


def is_sticky_device_error(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception it was raised from) says the CUDA context is lost."""
    seen: BaseException | None = exc
    for _ in range(8):  # the chain of causes, bounded
        if seen is None:
            return False
        code = getattr(seen, "error_code", None)
        if isinstance(code, int) and code in STICKY_CUDA_ERRORS:
            return True
        if isinstance(seen, RuntimeError):
            text = str(seen).lower()
            if any(message in text for message in STICKY_MESSAGES):
                return True
        seen = seen.__cause__ or seen.__context__
    return False


@dataclass(frozen=True)
class DeviceFault:
    """The first sticky error of the executor's device."""

    error_id: str
    device: str
    error: str

    def describe(self) -> str:
        return (
            f"device fault on {self.device} (error id {self.error_id}): {self.error}; this "
            "executor stops and restarts"
        )


class DeviceFaultError(Unavailable):
    """A call refused or failed because the executor's device faulted."""

    def __init__(self, fault: DeviceFault) -> None:
        super().__init__(f"{fault.describe()}; retry on another replica")
        self.fault = fault


#: Called once, on the thread that saw the fault, after it was logged and counted.
FaultListener = Callable[[DeviceFault], None]


class DeviceWatch:
    """Records the first sticky device error and turns every later call away (see the
    module doc). ``device``: how logs and messages name the device."""

    def __init__(self, device: str, metrics: ExecutorMetrics) -> None:
        self.device = device
        self._metrics = metrics
        self._lock = threading.Lock()
        self._fault: DeviceFault | None = None
        self._listeners: list[FaultListener] = []

    @property
    def fault(self) -> DeviceFault | None:
        return self._fault

    def on_fault(self, listener: FaultListener) -> None:
        """Calls ``listener`` on the first fault (at once if there was one already)."""
        with self._lock:
            fault = self._fault
            if fault is None:
                self._listeners.append(listener)
                return
        listener(fault)

    def check(self) -> None:
        """Raises DeviceFaultError once the device faulted."""
        fault = self._fault
        if fault is not None:
            raise DeviceFaultError(fault)

    def observe(self, exc: BaseException) -> DeviceFault | None:
        """The device's fault if ``exc`` is (or follows) a sticky device error, else None."""
        if self._fault is None and not is_sticky_device_error(exc):
            return None
        with self._lock:
            if self._fault is not None:
                return self._fault
            fault = DeviceFault(uuid.uuid4().hex[:12], self.device, _first_line(exc))
            self._fault = fault
            listeners, self._listeners = self._listeners, []
        self._metrics.device_faults.inc()
        log_event(
            log,
            "device_fault",
            logging.CRITICAL,
            exc_info=exc,
            error_id=fault.error_id,
            device=fault.device,
            error=fault.error,
        )
        for listener in listeners:
            listener(fault)
        return fault

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Fails fast after a fault, and raises what ``translate`` makes of an error raised
        inside."""
        self.check()
        try:
            yield
        except Exception as exc:
            translated = self.translate(exc)
            if translated is exc:
                raise
            raise translated from exc

    def translate(self, exc: BaseException) -> BaseException:
        """A sticky device error as DeviceFaultError, a device out of memory as
        ResourceExhausted; any other error unchanged."""
        if isinstance(exc, DeviceFaultError):
            return exc
        if isinstance(exc, torch.OutOfMemoryError):
            return ResourceExhausted(
                f"the device ran out of memory for this request ({_first_line(exc)}); retry "
                "later, with fewer tokens, or on another replica"
            )
        fault = self.observe(exc)
        return exc if fault is None else DeviceFaultError(fault)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
