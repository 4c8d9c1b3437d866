"""Forward's input and output through a copy engine or through ``copy_bytes``, beside a bulk
copy: ``python -m kernels.bench_host_copy`` (a CUDA GPU).

A Forward-like step: 64 KB in (16×2048 bf16), 8 matmuls of 16×2048×2048, 64 KB out, then one
synchronisation, timed ``STEPS`` times (p50 / p90 µs). Three ways to move its input and output:
``copy_`` from and to page-locked host memory (a copy engine), ``copy_bytes`` launched eagerly,
and ``copy_bytes`` captured with the matmuls in one CUDA graph. Beside each, in turn: nothing,
and a 630 MB host→device or device→host copy looping on another stream, as a load's slot
write does. Then the rate of each way of copying 2–67 MB alone.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from kernels.host_copy import copy_bytes

T, H, MATMULS = 16, 2048, 8
STEPS = 300
BULK_BYTES = 630 << 20


def _step(zero_copy: bool, host_in: torch.Tensor, host_out: torch.Tensor) -> Callable[[], None]:
    device_in = torch.empty(T, H, dtype=torch.bfloat16, device="cuda")
    weights = [torch.randn(H, H, device="cuda").bfloat16() / 50 for _ in range(MATMULS)]

    def step() -> None:
        if zero_copy:
            copy_bytes(device_in, host_in)
        else:
            device_in.copy_(host_in, non_blocking=True)
        x = device_in
        for w in weights:
            x = x @ w
        if zero_copy:
            copy_bytes(host_out, x)
        else:
            host_out.copy_(x, non_blocking=True)

    return step


def _graphed(step: Callable[[], None]) -> Callable[[], None]:
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def _bulk(direction: str, stop: threading.Event) -> None:
    host = torch.empty(BULK_BYTES, dtype=torch.uint8).pin_memory()
    device = torch.empty(BULK_BYTES, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    with torch.cuda.stream(stream):
        while not stop.is_set():
            if direction == "h2d":
                device.copy_(host, non_blocking=True)
            else:
                host.copy_(device, non_blocking=True)
            stream.synchronize()


def _percentiles(run: Callable[[], None]) -> tuple[float, float]:
    for _ in range(20):
        run()
        torch.cuda.synchronize()
    times = []
    for _ in range(STEPS):
        start = time.perf_counter()
        run()
        torch.cuda.current_stream().synchronize()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[STEPS // 2] * 1e6, times[STEPS * 9 // 10] * 1e6


def _rates(nbytes: int) -> list[float]:
    """GB/s of ``nbytes`` in and out, by a copy engine and by ``copy_bytes``, 20 copies each."""
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    device = torch.empty_like(host, device="cuda")
    copies: list[Callable[[], object]] = [
        lambda: device.copy_(host, non_blocking=True),
        lambda: copy_bytes(device, host),
        lambda: host.copy_(device, non_blocking=True),
        lambda: copy_bytes(host, device),
    ]
    rates = []
    for copy in copies:
        copy()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(20):
            copy()
        torch.cuda.synchronize()
        rates.append(nbytes * 20 / (time.perf_counter() - start) / 1e9)
    return rates


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("kernels.bench_host_copy needs a CUDA GPU")
    host_in = torch.randn(T, H).bfloat16().pin_memory()
    host_out = torch.empty(T, H, dtype=torch.bfloat16).pin_memory()
    ways = {
        "copy engine": _step(False, host_in, host_out),
        "copy_bytes, eager": _step(True, host_in, host_out),
    }
    ways["copy_bytes, in a graph"] = _graphed(ways["copy_bytes, eager"])
    print(f"\n{torch.cuda.get_device_name()}, {time.strftime('%Y-%m-%d')}\n")
    print("| beside it | " + " | ".join(f"{w} p50 / p90 µs" for w in ways) + " |")
    print("|---|" + "---|" * len(ways))
    for beside in ("nothing", "h2d", "d2h"):
        stop = threading.Event()
        bulk = None
        if beside != "nothing":
            bulk = threading.Thread(target=_bulk, args=(beside, stop))
            bulk.start()
            time.sleep(0.3)
        try:
            cells = [_percentiles(run) for run in ways.values()]
        finally:
            stop.set()
            if bulk is not None:
                bulk.join()
        label = "nothing" if beside == "nothing" else f"a 630 MB {beside.upper()} copy, looping"
        print(f"| {label} | " + " | ".join(f"{p50:,.0f} / {p90:,.0f}" for p50, p90 in cells) + " |")
    print(
        "\n| bytes | in, copy engine GB/s | in, copy_bytes | out, copy engine | out, copy_bytes |"
    )
    print("|---:|---:|---:|---:|---:|")
    for rows in (512, 4096, 16384):
        nbytes = rows * H * 2
        rates = " | ".join(f"{r:.1f}" for r in _rates(nbytes))
        print(f"| {nbytes / 1e6:.1f} MB | {rates} |")


if __name__ == "__main__":
    main()
