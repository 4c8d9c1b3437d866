"""``make demo``: the whole product on one machine, from nothing.

1. Writes a small Qwen3-MoE-shaped base checkpoint and three PEFT-format adapters with the
   project's own tooling (``executor_service.synthetic``; no hub download).
2. Starts a registry (SQLite + a local blob folder) and an executor (the GPU through the
   Triton kernels if there is one, else the CPU through the torch reference), as the console
   scripts an operator runs, on free ports of 127.0.0.1.
3. Registers the base model and uploads the adapters with ``adapterctl``.
4. Sends Forward calls that mix adapters and the base model from the Python client, and checks
   every answer against an independent reference: the LoRA deltas merged into the expert
   weights, computed in float32 by the torch reference.
5. Prints what happened and shuts both services down with SIGTERM.

Everything lives under ``.demo/`` and is made afresh on each run, so the demo is repeatable.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import grpc
import torch
from rich.console import Console
from rich.table import Table

from executor_service.model_loader import load_base_model
from executor_service.packer import PackedAdapter, pack_adapter
from executor_service.synthetic import (
    SyntheticAdapter,
    SyntheticBase,
    write_adapter,
    write_base_checkpoint,
)
from kernels import MoELayerWeights, moe_forward_reference
from moelora.client.adapter_files import CONFIG_FILE, WEIGHTS_FILE
from moelora.client.executor import ExecutorClient, ForwardResult
from moelora.client.health import wait_until_serving
from moelora.client.tensors import dtype_name
from shared.adapter_format import AdapterFormat
from shared.ports import free_port

BIN = Path(sys.executable).parent
BASE_NAME = "demo-qwen3-moe"
BASE = SyntheticBase(
    "qwen3_moe", hidden_size=256, moe_intermediate_size=128, num_experts=16, top_k=4, num_layers=2
)
#: name -> (what it adapts, seed); uploaded in this order.
ADAPTERS = {
    "sql-expert": (SyntheticAdapter(rank=8, alpha=16.0), 1),
    "chat-tone": (SyntheticAdapter(rank=4, alpha=8.0, targets=("down_proj",)), 2),
    "legacy-2d": (SyntheticAdapter(rank=2, alpha=4.0, format=AdapterFormat.PER_EXPERT), 3),
}
MAX_RANK = 8
console = Console()


@dataclass
class Service:
    name: str
    process: subprocess.Popen[bytes]
    log: Path

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


@contextmanager
def service(name: str, args: list[str], log: Path, health: str, address: str) -> Iterator[Service]:
    """Runs a console script until the block ends; waits for it to report SERVING."""
    with log.open("wb") as sink:
        process = subprocess.Popen([str(BIN / name), *args], stdout=sink, stderr=subprocess.STDOUT)
    running = Service(name, process, log)
    try:
        with grpc.insecure_channel(address) as channel:
            try:
                wait_until_serving(channel, health, timeout=300)
            except TimeoutError:
                raise SystemExit(f"{name} did not start; its log:\n{log.read_text()}") from None
        yield running
    finally:
        code = running.stop()
        console.print(f"  {name} stopped (exit {code})")


def adapterctl(address: str, *args: str) -> dict[str, object]:
    done = subprocess.run(
        [str(BIN / "adapterctl"), "--address", address, "--json", *args],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"adapterctl {' '.join(args)} failed: {done.stderr.strip()}")
    result = json.loads(done.stdout) if done.stdout.strip() else {}
    assert isinstance(result, dict)
    return result


def merged_layer(layer: MoELayerWeights, packed: PackedAdapter, index: int) -> MoELayerWeights:
    """``layer`` with the adapter's deltas added into its expert weights, in float32: the
    reference that shares no code with the serving path's LoRA kernels."""
    lora = packed.layers.get(index)
    w13, w2 = layer.w13.float().clone(), layer.w2.float().clone()
    if lora is not None:
        if lora.a13 is not None and lora.b13 is not None:
            w13 += torch.bmm(lora.b13.float(), lora.a13.float())
        if lora.a2 is not None and lora.b2 is not None:
            w2 += torch.bmm(lora.b2.float(), lora.a2.float())
    return replace(layer, w13=w13, w2=w2, router_weight=layer.router_weight.float())


def reference(
    layers: Mapping[int, MoELayerWeights],
    packed: dict[str, PackedAdapter],
    layer: int,
    hidden: torch.Tensor,
    segments: list[tuple[int, str | None]],
) -> torch.Tensor:
    """Each segment through its adapter's merged weights (or the base), in float32."""
    rows, start = [], 0
    for count, name in segments:
        base = layers[layer]
        weights = base if name is None else merged_layer(base, packed[name], layer)
        rows.append(moe_forward_reference(hidden[start : start + count].float(), weights))
        start += count
    return torch.cat(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path(".demo"))
    parser.add_argument("--requests", type=int, default=20, help="Forward calls to time")
    args = parser.parse_args()
    work = args.workdir.resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)

    console.rule("[bold]moe-lora-serve demo")
    console.print("1. writing a base checkpoint and PEFT adapters with the project's tooling")
    checkpoint = work / "base-model"
    spec = write_base_checkpoint(checkpoint, BASE, dtype=torch.bfloat16, seed=0)
    for name, (adapter, seed) in ADAPTERS.items():
        write_adapter(work / "adapters" / name, spec, adapter, seed=seed)
    console.print(
        f"   {spec.model_type}: H={spec.hidden_size} I={spec.moe_intermediate_size} "
        f"E={spec.num_experts} k={spec.top_k}, MoE layers {list(spec.moe_layers)}"
    )

    registry_address = f"127.0.0.1:{free_port()}"
    executor_address = f"127.0.0.1:{free_port()}"
    with ExitStack() as stack:
        console.print(f"2. starting the registry on {registry_address} (SQLite + local blobs)")
        stack.enter_context(
            service(
                "moelora-registry",
                [
                    "--listen",
                    registry_address,
                    "--data-dir",
                    str(work / "registry"),
                    "--metrics-listen",
                    "",
                    "--http-listen",
                    "127.0.0.1:0",
                    "--drain-seconds",
                    "2",
                ],
                work / "registry.log",
                "moelora.v1.AdapterRegistry",
                registry_address,
            )
        )

        console.print("3. registering the base model and uploading adapters with adapterctl")
        adapterctl(registry_address, "base-model", "register", str(checkpoint), "--name", BASE_NAME)
        for name in ADAPTERS:
            extra = ["--alias", "prod"] if name == "sql-expert" else []
            adapterctl(
                registry_address,
                "upload",
                str(work / "adapters" / name),
                "--name",
                name,
                "--base-model",
                BASE_NAME,
                *extra,
            )
        listing = subprocess.run(
            [str(BIN / "adapterctl"), "--address", registry_address, "list"],
            capture_output=True,
            text=True,
            check=True,
        )
        console.print(listing.stdout.rstrip())

        console.print(f"4. starting the executor on {executor_address} (pulls from the registry)")
        stack.enter_context(
            service(
                "moelora-executor",
                [
                    "--listen",
                    executor_address,
                    "--base-model-path",
                    str(checkpoint),
                    "--base-model-name",
                    BASE_NAME,
                    "--registry-address",
                    registry_address,
                    "--disk-cache-dir",
                    str(work / "executor-cache"),
                    "--num-slots",
                    "4",
                    "--max-rank",
                    str(MAX_RANK),
                    "--metrics-listen",
                    "",
                    "--drain-seconds",
                    "2",
                ],
                work / "executor.log",
                "moelora.v1.Executor",
                executor_address,
            )
        )
        client = stack.enter_context(ExecutorClient(executor_address, timeout=120))
        run_forward_calls(client, checkpoint, work, args.requests)
    console.print(f"logs: {work}/registry.log, {work}/executor.log")


def run_forward_calls(client: ExecutorClient, checkpoint: Path, work: Path, requests: int) -> None:
    info = client.get_executor_info()
    dtype = getattr(torch, dtype_name(info.compute_dtype))
    console.print(
        f"   executor: {info.device}, backend {info.backend}, "
        f"{info.num_slots} slots of rank {info.max_rank}"
    )
    model = load_base_model(checkpoint, torch.device("cpu"), torch.float32)
    packed = {
        name: pack_adapter(
            json.loads((work / "adapters" / name / CONFIG_FILE).read_text()),
            work / "adapters" / name / WEIGHTS_FILE,
            model.spec,
            MAX_RANK,
            torch.float32,
        )
        for name in ADAPTERS
    }
    # Tolerance on ‖out − ref‖/‖ref‖: float32 math on the CPU, bf16 operands on a GPU.
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2

    console.print("5. Forward calls mixing adapters and the base model")
    mixes: list[list[tuple[int, str | None]]] = [
        [(5, "sql-expert@prod"), (3, None), (4, "chat-tone"), (4, "legacy-2d")],
        [(1, "chat-tone")],
        [(40, None), (24, "sql-expert:1")],
    ]
    table = Table("layer", "segments", "resolved", "rel. error", "ok")
    generator = torch.Generator().manual_seed(7)
    worst = 0.0
    for layer in model.spec.moe_layers:
        for segments in mixes:
            tokens = sum(n for n, _ in segments)
            hidden = torch.randn(tokens, model.spec.hidden_size, generator=generator).to(dtype)
            result: ForwardResult[torch.Tensor] = client.forward(layer, hidden, segments)
            names = [
                None if ref is None else ref.split("@")[0].split(":")[0] for _, ref in segments
            ]
            expected = reference(
                model.layers,
                packed,
                layer,
                hidden,
                [(n, name) for (n, _), name in zip(segments, names, strict=True)],
            )
            error = float((result.output.float() - expected).norm() / expected.norm())
            worst = max(worst, error)
            table.add_row(
                str(layer),
                " ".join(f"{n}×{ref or 'base'}" for n, ref in segments),
                " ".join(r or "base" for r in result.resolved_adapters),
                f"{error:.2e}",
                "[green]yes" if error < tolerance else "[red]NO",
            )
    console.print(table)

    latencies, server_us = [], []
    layer = model.spec.moe_layers[0]
    hidden = torch.randn(64, model.spec.hidden_size, generator=generator).to(dtype)
    segments = [(16, "sql-expert@prod"), (16, None), (16, "chat-tone"), (16, "legacy-2d")]
    for _ in range(requests):
        start = time.perf_counter()
        result = client.forward(layer, hidden, segments)
        latencies.append((time.perf_counter() - start) * 1e3)
        server_us.append(result.server_time_us)
    console.print(
        f"   64 tokens, 4 segments: round trip p50 {statistics.median(latencies):.2f} ms, "
        f"executor {statistics.median(server_us) / 1e3:.2f} ms "
        f"({requests} calls)"
    )

    residency = Table("adapter", "where", "slot", "pinned", "rank", "bytes")
    for adapter in client.list_loaded_adapters().adapters:
        slot = "GPU slot" if info.device != "cpu" else "slot (CPU)"
        where = {1: slot, 2: "host cache", 3: "disk"}.get(adapter.location, "?")
        residency.add_row(
            f"{adapter.name}:{adapter.version}",
            where,
            str(adapter.slot) if adapter.slot >= 0 else "-",
            "yes" if adapter.pinned else "no",
            str(adapter.rank),
            str(adapter.size_bytes),
        )
    console.print(residency)
    verdict = "[green]all answers match" if worst < tolerance else "[red]MISMATCH"
    console.print(f"   worst relative error {worst:.2e} (tolerance {tolerance:.0e}): {verdict}")
    if worst >= tolerance:
        raise SystemExit(1)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
