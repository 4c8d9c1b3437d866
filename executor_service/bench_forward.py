"""Forward latency over gRPC vs kernel-only time: ``python -m executor_service.bench_forward``.

Writes a one-layer synthetic checkpoint of a real shape (default: a Qwen3-30B-A3B MoE layer,
H=2048, I=768, E=128, k=8, random bf16 weights) and rank-16 PEFT adapters, starts an executor
in this process on 127.0.0.1, and for each T times:

* ``grpc``: ``ExecutorClient.forward`` round trips (encode, send, decode, compute, reply),
* ``server``: the ``server_time_us`` the executor reports (decode to encode),
* ``kernel``: ``kernels.moe_forward`` alone on the executor's layer and slot buffers with the
  same adapters, timed with CUDA events (host timer on the CPU).

Tokens are split into ``--adapters`` equal segments, one adapter each, named ``name:1`` (so
that no source lookup is timed) and all resident (pinned, warm slots). Prints a markdown table
of medians. ``--shape tiny --device cpu`` is a smoke run.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from prometheus_client import CollectorRegistry

from executor_service.app import ExecutorApp
from executor_service.client import ExecutorClient
from executor_service.config import ExecutorSettings
from executor_service.metrics import ExecutorMetrics
from executor_service.runtime import ExecutorRuntime
from executor_service.synthetic import (
    SyntheticAdapter,
    SyntheticBase,
    write_adapter,
    write_base_checkpoint,
)
from kernels import LoRAContext, moe_forward

SHAPES = {
    "qwen3-30b-a3b": SyntheticBase(
        "qwen3_moe",
        hidden_size=2048,
        moe_intermediate_size=768,
        num_experts=128,
        top_k=8,
        num_layers=1,
    ),
    "tiny": SyntheticBase("qwen3_moe", hidden_size=64, moe_intermediate_size=32, num_layers=1),
}


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def _time_kernel(fn: Callable[[], object], iters: int, device: torch.device) -> float:
    """Median seconds of ``fn`` (CUDA events on a GPU)."""
    samples = []
    for _ in range(iters):
        if device.type == "cuda":
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(float(start.elapsed_time(end)) / 1e3)
        else:
            begin = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - begin)
    return statistics.median(samples)


def _segments(tokens: int, names: list[str]) -> list[tuple[int, str]]:
    """``tokens`` split into equal runs, one adapter each (fewer runs when T is small)."""
    count = min(len(names), tokens)
    sizes = [tokens // count + (1 if i < tokens % count else 0) for i in range(count)]
    return [(n, names[i]) for i, n in enumerate(sizes)]


def _kernel_fn(
    runtime: ExecutorRuntime, layer: int, hidden: torch.Tensor, segments: list[tuple[int, str]]
) -> Callable[[], object]:
    """The kernel call the executor makes for this request, without the service around it."""
    adapters = runtime.adapters
    slots_of = {s.adapter.label: s.slot for s in adapters.list_loaded() if s.slot is not None}
    token_slots = torch.repeat_interleave(
        torch.tensor([slots_of[name] for _, name in segments], dtype=torch.int32),
        torch.tensor([n for n, _ in segments]),
    ).to(runtime.placement.device)
    lora = LoRAContext(adapters.lora_slots(layer), token_slots)
    x = hidden.to(device=runtime.placement.device, dtype=runtime.placement.dtype)
    weights = runtime.model.layers[layer]
    backend = runtime.placement.kernel_backend
    return lambda: moe_forward(x, weights, lora, backend=backend)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", default="1,64,512", help="comma list of T")
    parser.add_argument("--adapters", type=int, default=4, help="distinct adapters per batch")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--wire-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    wire = getattr(torch, args.wire_dtype)
    folders = [f"bench-{i}" for i in range(args.adapters)]
    names = [f"{folder}:1" for folder in folders]
    with tempfile.TemporaryDirectory(prefix="bench-forward-") as tmp:
        root = Path(tmp)
        spec = write_base_checkpoint(root / "base", SHAPES[args.shape], dtype=dtype)
        for seed, folder in enumerate(folders):
            adapter = SyntheticAdapter(rank=args.rank)
            write_adapter(root / "adapters" / folder, spec, adapter, seed=seed)
        settings = ExecutorSettings.model_validate(
            {
                "listen": "127.0.0.1:0",
                "base_model_path": root / "base",
                "adapter_dir": root / "adapters",
                "device": args.device,
                "num_slots": max(2, args.adapters + 1),
                "max_rank": args.rank,
                "max_tokens_per_request": max(int(t) for t in args.tokens.split(",")),
                "metrics_listen": "",
                "drain_seconds": 1.0,
                "log_level": "warning",
            }
        )
        app = ExecutorApp(settings, ExecutorMetrics(CollectorRegistry()))
        app.start()
        with ExecutorClient(app.address, timeout=600) as client:
            client.wait_until_serving(timeout=600)
            runtime = app.runtime
            assert runtime is not None
            for name in names:
                client.pin_adapter(name)
            layer = spec.moe_layers[0]
            rows = []
            for tokens in (int(t) for t in args.tokens.split(",")):
                hidden = torch.randn(tokens, spec.hidden_size, dtype=wire)
                segments = _segments(tokens, names)
                for _ in range(3):
                    client.forward(layer, hidden, segments)
                grpc_s, server_s = [], []
                for _ in range(args.iters):
                    begin = time.perf_counter()
                    result = client.forward(layer, hidden, segments)
                    grpc_s.append(time.perf_counter() - begin)
                    server_s.append(result.server_time_us / 1e6)
                kernel = _kernel_fn(runtime, layer, hidden, segments)
                kernel()
                kernel_s = _time_kernel(kernel, args.iters, device)
                rows.append((tokens, _median_ms(grpc_s), _median_ms(server_s), kernel_s * 1e3))
        app.drain()
    device_name = runtime.placement.device_name
    print(
        f"\nForward latency, {args.shape} layer, {device_name}, compute {dtype}, wire "
        f"{args.wire_dtype}, rank {args.rank}, {args.adapters} adapters per batch, medians\n"
    )
    print("| T | gRPC round trip (ms) | server time (ms) | kernel only (ms) | gRPC − kernel (ms) |")
    print("|---:|---:|---:|---:|---:|")
    for tokens, grpc_ms, server_ms, kernel_ms in rows:
        print(
            f"| {tokens} | {grpc_ms:.3f} | {server_ms:.3f} | {kernel_ms:.3f} | "
            f"{grpc_ms - kernel_ms:.3f} |"
        )


if __name__ == "__main__":
    main()
