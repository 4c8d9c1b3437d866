"""Autotuned configurations on disk, one JSON file per (GPU, Triton version, layer shape).

Layout: ``<dir>/<GPU name>/triton-<version>/<E=..,H=..,I=..,k=..>.json`` holding
``{"r=16": {"1": {...MoEConfig...}, ...}, "r=0": {...}}``. The Triton version is part of the
key because a compiler update changes what the best tiles are (SGLang keys its tables so too).
Files are replaced atomically, so a reader never sees half a file and two executors sharing
the directory (a volume) at worst both tune.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import triton

from kernels.configs import MoEConfig
from kernels.model_shape import LayerShape

#: configurations of one shape: rank → token count → configuration.
RankTable = dict[int, dict[int, MoEConfig]]


class ConfigCache:
    """Reads and writes the autotuned configurations under ``directory``."""

    def __init__(self, directory: Path, triton_version: str = triton.__version__) -> None:
        self.directory = directory.expanduser()
        self.triton_version = triton_version

    def path(self, gpu: str, shape: LayerShape) -> Path:
        return self.directory / gpu / f"triton-{self.triton_version}" / f"{shape.key}.json"

    def load(self, gpu: str, shape: LayerShape) -> RankTable:
        """The cached configurations of this shape on this GPU; empty if none (or unreadable:
        a damaged file is tuned again, not fatal)."""
        path = self.path(gpu, shape)
        try:
            raw = json.loads(path.read_text())
            return {
                int(rank.removeprefix("r=")): {
                    int(m): MoEConfig.from_json(cfg) for m, cfg in by_m.items()
                }
                for rank, by_m in raw.items()
            }
        except (OSError, ValueError, KeyError, TypeError):
            return {}

    def store(self, gpu: str, shape: LayerShape, rank: int, configs: dict[int, MoEConfig]) -> Path:
        """Merge ``configs`` (token count → configuration) for ``rank`` into the file."""
        table = self.load(gpu, shape)
        table.setdefault(rank, {}).update(configs)
        raw = {
            f"r={r}": {str(m): cfg.to_json() for m, cfg in sorted(by_m.items())}
            for r, by_m in sorted(table.items())
        }
        path = self.path(gpu, shape)
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            f.write(json.dumps(raw, indent=1) + "\n")
        Path(f.name).replace(path)
        return path
