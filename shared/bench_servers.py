"""Helpers of the benchmarks: servers in their own processes, and a large PEFT adapter.

Each server is a separate process (its own GIL, as in production), stopped when the
``with`` block ends. Knows no service: the registry is started by its console script.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import boto3
import grpc
import numpy as np

from moelora.client.adapter_files import CONFIG_FILE, WEIGHTS_FILE
from moelora.client.health import wait_until_serving
from moelora.client.model_spec import ModelSpec
from shared.ports import free_port

_CHUNK_ELEMENTS = 1 << 24


def write_adapter(folder: Path, spec: ModelSpec, rank: int, seed: int = 0) -> int:
    """A PEFT 3D adapter for every MoE layer of ``spec``, random finite bf16 weights (a
    ``seed`` each); its total size in bytes. Streams to disk: a 1 GB adapter needs no 1 GB."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": [],
        "target_parameters": ["gate_up_proj", "down_proj"],
    }
    (folder / CONFIG_FILE).write_text(json.dumps(config))
    h, i, e = spec.hidden_size, spec.moe_intermediate_size, spec.num_experts
    shapes: dict[str, list[int]] = {}
    for layer in spec.moe_layers:
        stem = f"base_model.model.model.layers.{layer}.mlp.experts"
        shapes[f"{stem}.base_layer.lora_A.weight"] = [rank * e, h]
        shapes[f"{stem}.base_layer.lora_B.weight"] = [2 * i, rank * e]
        shapes[f"{stem}.lora_A.weight"] = [rank * e, i]
        shapes[f"{stem}.lora_B.weight"] = [h, rank * e]
    header: dict[str, object] = {}
    offset = 0
    for name, shape in shapes.items():
        nbytes = int(np.prod(shape)) * 2
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    rng = np.random.default_rng(seed)
    block = (rng.standard_normal(_CHUNK_ELEMENTS, dtype=np.float32) * 0.01).view(np.uint32)
    bf16 = (block >> 16).astype(np.uint16).tobytes()  # truncation: finite, like the floats
    with (folder / WEIGHTS_FILE).open("wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        left = offset
        while left:
            piece = bf16[: min(left, len(bf16))]
            f.write(piece)
            left -= len(piece)
    return (folder / CONFIG_FILE).stat().st_size + (folder / WEIGHTS_FILE).stat().st_size


@contextmanager
def process(args: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
        try:
            yield proc
        finally:
            proc.terminate()
            proc.wait(60)


@contextmanager
def moto_server(workdir: Path) -> Iterator[str]:
    # moto accepts any credentials; the registry process inherits these.
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        os.environ.setdefault(key, "bench")
    port = free_port()
    args = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    with process(args, workdir / "moto.log"):
        endpoint = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.2)
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(
            Bucket="bench-adapters"
        )
        yield endpoint


@contextmanager
def registry_server(workdir: Path, flags: Sequence[str]) -> Iterator[str]:
    address = f"127.0.0.1:{free_port()}"
    # The module, not the console script: runs where the package is only on PYTHONPATH.
    args = [
        sys.executable,
        "-m",
        "registry_service.main",
        "--listen",
        address,
        "--data-dir",
        str(workdir / "data"),
        "--auth",
        "off",
        "--metrics-listen",
        "",
        "--http-listen",  # blob URLs for the local store, on a free port
        "127.0.0.1:0",
        "--log-level",
        "warning",
        *flags,
    ]
    with process(args, workdir / "registry.log"), grpc.insecure_channel(address) as channel:
        wait_until_serving(channel, timeout=120)
        yield address
