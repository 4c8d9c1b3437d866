"""Upload and download throughput of the registry for a ~1 GB adapter, on the
local-directory backend and on S3 (moto's server in its own process).

    python -m registry_service.bench [--rank 13] [--repeat 2] [--backends local,s3,s3-single]

``s3`` moves objects in 64 MiB parts, 8 at a time (the default); ``s3-single``
in one PUT / one GET (--s3-part-bytes 5 GiB). moto answers every ranged GET by
copying the whole object, so its "s3" download row understates real S3.

The adapter is a valid PEFT 3D adapter (bf16) for a base model with
Qwen3-30B-A3B's MoE shape (48 layers, 128 experts, H 2048, I 768); rank 13
makes it 1.02 GB. The base model is registered from its config alone (the
registry needs the spec, not the weights). Each server is a separate
``moelora-registry`` process; the client is RegistryClient, i.e. what
adapterctl does: upload = 1 MiB chunks hashed as they are sent (sha256s in the
trailer) + server spool (hashed, written, flushed)/validate/blob write/commit;
download = one stream hashed by the server as it sends + client sha256 and write.
Presigned = one HTTP GET per file on GetDownloadUrls' URLs (``adapterctl download
--presigned``): straight from the bucket (S3), or from the registry's blob HTTP server
(local directory, sendfile) + client sha256 and write.
Needs the dev extra (moto) for the S3 rows.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from moelora.client.model_spec import ModelSpec, spec_from_config
from moelora.client.registry import RegistryClient
from shared.bench_servers import moto_server, registry_server, write_adapter

BASE_NAME = "qwen3-30b-a3b-shape"
CONFIG = {
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "moe_intermediate_size": 768,
    "intermediate_size": 6144,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "hidden_act": "silu",
}
_MB = 1e6


def base_spec() -> ModelSpec:
    text = json.dumps(CONFIG)
    fingerprint = "sha256:" + hashlib.sha256(text.encode()).hexdigest()
    return spec_from_config(
        CONFIG, config_json=text, checkpoint_dtype="bfloat16", fingerprint=fingerprint
    )


@dataclass
class Row:
    backend: str
    upload: list[float]
    download: list[float]
    presigned: list[float]


def measure(backend: str, address: str, adapter: Path, repeat: int, workdir: Path) -> Row:
    row = Row(backend, [], [], [])
    with RegistryClient(address, timeout=600) as client:
        client.register_base_model(base_spec().to_proto(BASE_NAME))
        for n in range(repeat):
            start = time.perf_counter()
            version = client.upload(adapter, "bench", BASE_NAME, timeout=3600)
            row.upload.append(time.perf_counter() - start)
            out = workdir / f"download-{n}"
            start = time.perf_counter()
            client.download(f"bench:{version.version}", out, timeout=3600)
            row.download.append(time.perf_counter() - start)
            shutil.rmtree(out)
            start = time.perf_counter()
            client.download_presigned(f"bench:{version.version}", out)
            row.presigned.append(time.perf_counter() - start)
            shutil.rmtree(out)
    return row


def _rate(size: int, seconds: list[float]) -> str:
    if not seconds:
        return "-"
    return f"{size / _MB / statistics.median(seconds):8.0f}"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m registry_service.bench", description=__doc__)
    parser.add_argument("--rank", type=int, default=13, help="LoRA rank; 13 makes ~1.02 GB")
    parser.add_argument("--repeat", type=int, default=2, help="uploads/downloads per backend")
    parser.add_argument("--backends", default="local,s3,s3-single")
    parser.add_argument("--workdir", type=Path, help="default: a temporary folder")
    args = parser.parse_args(argv)
    root = args.workdir or Path(tempfile.mkdtemp(prefix="registry-bench-"))
    spec = base_spec()
    adapter = root / "adapter"
    started = time.perf_counter()
    size = write_adapter(adapter, spec, args.rank)
    print(
        f"adapter: {size / _MB:.0f} MB (rank {args.rank}, bf16, {len(spec.moe_layers)} layers, "
        f"{spec.num_experts} experts), written in {time.perf_counter() - started:.1f}s"
    )
    common = ["--max-rank", str(max(args.rank, 256))]
    rows = []
    for backend in args.backends.split(","):
        workdir = root / backend
        workdir.mkdir(exist_ok=True)
        if backend == "local":
            with registry_server(workdir, common) as address:
                rows.append(measure(backend, address, adapter, args.repeat, workdir))
        elif backend in ("s3", "s3-single"):
            # s3: 64 MiB parts, 8 at a time; s3-single: one PUT and one GET per object.
            part = 64 * 2**20 if backend == "s3" else 5 * 2**30
            with moto_server(workdir) as endpoint:
                flags = [
                    *common,
                    "--blob-url",
                    "s3://bench-adapters/registry",
                    "--s3-endpoint-url",
                    endpoint,
                    "--s3-region",
                    "us-east-1",
                    "--s3-path-style",
                    "--s3-part-bytes",
                    str(part),
                ]
                with registry_server(workdir, flags) as address:
                    rows.append(measure(backend, address, adapter, args.repeat, workdir))
        else:
            parser.error(f"unknown backend {backend!r}")
    print(f"\nregistry throughput, MB/s (1 MB = 10^6 bytes), median of {args.repeat}")
    print(f"{'backend':10} {'upload':>8} {'download':>8} {'presigned':>9}")
    for row in rows:
        print(
            f"{row.backend:10} {_rate(size, row.upload)} {_rate(size, row.download)} "
            f"{_rate(size, row.presigned):>9}"
        )
    if args.workdir is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
