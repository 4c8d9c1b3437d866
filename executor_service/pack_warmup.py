"""Where a CUDA executor loads the pack's GPU kernels before the first adapter needs them.

CUDA loads a kernel on its first launch (lazy module loading, CUDA's default), and a pack
launches kernels that serving never does: copies between the stored and the serving dtype,
B's transposing gather, the scaling, the finite checks. On an H100 host the first cold load
after start-up spent 100–270 ms on that inside its first layer, and with
``CUDA_MODULE_LOADING=EAGER`` none (docs/decisions/0009-pack-where-the-executor-computes.md).
So at start-up
a CUDA executor packs tiny synthetic adapters of its own model (rank 1, one layer, bf16, each
format the model type has) from files, the way a load packs a download.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch

from executor_service.adapters import PackSettings
from executor_service.host_pool import HostPool
from executor_service.packer import pack_adapter
from executor_service.synthetic import SyntheticAdapter, write_adapter
from moelora.client.adapter_files import CONFIG_FILE, WEIGHTS_FILE
from shared.adapter_format import AdapterFormat


def warm_up_packing(pack: PackSettings, memory: HostPool) -> float:
    """Packs one tiny adapter per format as ``pack`` says, into ``memory``; returns the
    seconds it took."""
    start = time.perf_counter()
    spec = pack.spec
    formats = [AdapterFormat.TARGET_PARAMETERS]
    if spec.type.peft_2d_modules:
        formats.append(AdapterFormat.PER_EXPERT)
    tiny = [SyntheticAdapter(rank=1, format=f, layers=spec.moe_layers[:1]) for f in formats]
    with tempfile.TemporaryDirectory(prefix="pack-warmup-") as tmp:
        for index, adapter in enumerate(tiny):
            folder = write_adapter(Path(tmp) / str(index), spec, adapter, dtype=torch.bfloat16)
            pack_adapter(
                json.loads((folder / CONFIG_FILE).read_text()),
                folder / WEIGHTS_FILE,
                spec,
                pack.max_rank,
                pack.dtype,
                device=pack.device,
                page_cache_dma=pack.page_cache_dma,
                memory=memory,
            )
    return time.perf_counter() - start
