"""Which launch configuration a forward uses, and where it came from.

Order, per (GPU, layer shape, LoRA rank):

1. ``table``: the tuned table shipped for this GPU (``kernels/configs/<GPU>.json``);
2. ``autotuned``: configurations tuned on this machine (``kernels.config_cache``);
3. the same two at the nearest tuned rank (log distance; a rank's tiles suit its neighbours
   far better than the heuristic does), reported e.g. as ``table (rank 16)``;
4. ``heuristic`` (``kernels.heuristic``).

Within a source the nearest tuned token count is used (log distance, ties to the smaller).
FP8 experts whose inputs are quantised too (``MoELayerWeights.fp8_activations``) run that
configuration on the FP8 tensor cores (``quantised_inputs``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch

from kernels.config_cache import ConfigCache, RankTable
from kernels.configs import MoEConfig, device_name, fit_stages, load_table, table_key
from kernels.heuristic import heuristic_config
from kernels.hopper_gemm import BLOCK_M as HOPPER_BLOCK_M
from kernels.hopper_gemm import on_hopper
from kernels.model_shape import LayerShape

TABLE, AUTOTUNED, HEURISTIC = "table", "autotuned", "heuristic"


@dataclass(frozen=True)
class Selection:
    """A configuration and its source: table, autotuned, heuristic, or one of the first two
    at another rank ("table (rank 16)")."""

    config: MoEConfig
    source: str


def _nearest(keys: list[int], target: int) -> int:
    return min(keys, key=lambda k: (abs(math.log(max(k, 1) / max(target, 1))), k))


class ConfigSelector:
    """Chooses configurations for one GPU from its table and an optional on-disk cache.

    ``use_tables=False`` skips the shipped table and the cache (heuristic only, or what was
    handed to ``add``): for measuring the heuristic, and autotuning without a table.
    """

    def __init__(
        self, gpu: str, cache: ConfigCache | None = None, *, use_tables: bool = True
    ) -> None:
        self.gpu = gpu
        self.cache = cache
        self.use_tables = use_tables
        self._tuned: dict[LayerShape, RankTable] = {}
        # Resolved (shape, rank) → source: a forward's lookup is a dict hit.
        self._resolved: dict[tuple[LayerShape, int], tuple[str, dict[int, MoEConfig] | None]] = {}

    def add(self, shape: LayerShape, rank: int, configs: dict[int, MoEConfig]) -> None:
        """Use ``configs`` (token count → configuration), autotuned in this process."""
        self._tuned.setdefault(_bare(shape), {}).setdefault(rank, {}).update(configs)
        self._resolved.clear()

    def select(self, tokens: int, shape: LayerShape, rank: int, dtype: torch.dtype) -> Selection:
        """The configuration for ``tokens`` rows of this shape in ``dtype`` (the hidden
        states'); rank 0 = no LoRA."""
        source, table = self._by_source(_bare(shape), rank)
        elem_size = torch.finfo(dtype).bits // 8
        if table is None:
            config = heuristic_config(
                tokens, shape.experts, shape.hidden, shape.inter, shape.top_k, elem_size,
                fp8=shape.fp8,
            )  # fmt: skip
        else:
            config = table[_nearest(list(table), tokens)]
        return Selection(fit_stages(config, elem_size, rank, fp8=shape.fp8), source)

    def source(self, shape: LayerShape, rank: int) -> str:
        return self._by_source(_bare(shape), rank)[0]

    def _by_source(self, shape: LayerShape, rank: int) -> tuple[str, dict[int, MoEConfig] | None]:
        key = (shape, rank)
        if key not in self._resolved:
            self._resolved[key] = self._resolve(shape, rank)
        return self._resolved[key]

    def _resolve(self, shape: LayerShape, rank: int) -> tuple[str, dict[int, MoEConfig] | None]:
        sources: list[tuple[str, RankTable]] = []
        if self.use_tables:
            shipped = load_table(self.gpu)
            table_ranks: RankTable = {}
            for r in _ranks_in(shipped, shape):
                table_ranks[r] = shipped[table_key(shape, r)]
            sources.append((TABLE, table_ranks))
            cached = self.cache.load(self.gpu, shape) if self.cache is not None else {}
            sources.append((AUTOTUNED, {**cached, **self._tuned.get(shape, {})}))
        else:
            sources.append((AUTOTUNED, self._tuned.get(shape, {})))
        for name, ranks in sources:
            if ranks.get(rank):
                return name, ranks[rank]
        # The base model (rank 0) has no LoRA columns; any tuned rank is as near as another.
        for name, ranks in sources:
            tuned = [r for r, by_m in ranks.items() if by_m and r > 0]
            if tuned:
                nearest = _nearest(tuned, max(rank, 1))
                return f"{name} (rank {nearest})", ranks[nearest]
        return HEURISTIC, None


def _bare(shape: LayerShape) -> LayerShape:
    """The shape without its display name (the key of tuned configurations)."""
    return dataclasses.replace(shape, name="")


def _ranks_in(table: dict[str, dict[int, MoEConfig]], shape: LayerShape) -> list[int]:
    prefix = shape.key + ",r="
    return [int(key.removeprefix(prefix)) for key in table if key.startswith(prefix)]


@functools.cache
def default_selector(gpu: str) -> ConfigSelector:
    """The selector of ``moe_forward`` calls given none: this GPU's table, else heuristic."""
    return ConfigSelector(gpu)


def selector_for(device: torch.device) -> ConfigSelector:
    return default_selector(device_name(device))


def quantising(config: MoEConfig) -> MoEConfig:
    """Both GEMMs on the FP8 tensor cores, their inputs quantised per row and 128 columns
    (``GemmConfig.fp8_activations``; the LoRA then takes the separate shrink)."""
    return config.each_gemm(fp8_activations=True, fused_shrink=False)


def quantised_inputs(config: MoEConfig, device: torch.device) -> MoEConfig:
    """``config`` (of FP8 experts) with both GEMMs' inputs quantised, on the FP8 tensor cores
    (the LoRA shrinks apart: they read the unquantised inputs); from tensor-core tiles (64 rows
    a block) up on an sm_90 GPU, on the Hopper kernels in their blocks of 128 rows. Measured
    on an H200 (kernels/BENCHMARKS.md): there 0.72-0.86x bf16's time from M = 512, where the
    Triton W8A8 loops take 3x; with streaming tiles the Triton W8A8 loops are the faster.
    Other GPUs run the Triton W8A8 loops throughout."""
    config = quantising(config)
    if config.decode or config.block_m < 64 or not on_hopper(device):
        return config
    return dataclasses.replace(config.each_gemm(hopper=True), block_m=HOPPER_BLOCK_M)
