"""The MoE kernels' launch configurations for the loaded model: from this GPU's tuned table,
else the on-disk cache of earlier autotuning, else autotuned now within
``--kernel-autotune-seconds`` (before the executor reports SERVING, so the CUDA graphs captured
for serving use the tuned kernels), else the heuristic. Logged and reported by GetExecutorInfo.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from executor_service.config import ExecutorSettings
from executor_service.model_loader import BaseModel
from kernels import ConfigCache, ConfigSelector, layer_shape
from kernels.autotune import autotune
from kernels.config_select import HEURISTIC
from kernels.configs import device_name
from moelora.client.logs import log_event

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KernelConfigReport:
    """Where one LoRA rank's configurations come from (GetExecutorInfo's KernelConfigInfo)."""

    rank: int
    source: str
    shape: str
    autotune_seconds: float = 0.0


@dataclass(frozen=True)
class KernelConfigs:
    selector: ConfigSelector | None  # None off the GPU (the torch reference needs none)
    reports: tuple[KernelConfigReport, ...]


def _untuned(source: str) -> bool:
    """No configurations tuned for this very rank: the heuristic, or a neighbouring rank's
    (a guess too; the rank served deserves its own tuning)."""
    return source == HEURISTIC or "(rank" in source


def prepare_kernel_configs(
    settings: ExecutorSettings, device: torch.device, model: BaseModel
) -> KernelConfigs:
    """Choose (and if need be autotune) the configurations for the model's shape at rank 0
    (batches without adapters) and at ``--max-rank``."""
    if device.type != "cuda" or not model.layers:
        return KernelConfigs(None, ())
    cache = ConfigCache(settings.kernel_cache_dir)
    selector = ConfigSelector(device_name(device), cache)
    layer = next(iter(model.layers.values()))
    shape = layer_shape(layer)
    seconds = dict.fromkeys((settings.max_rank, 0), 0.0)
    if settings.kernel_autotune_seconds > 0 and _untuned(selector.source(shape, settings.max_rank)):
        log_event(log, "kernel_autotune_started", shape=shape.key, rank=settings.max_rank,
                  budget_seconds=settings.kernel_autotune_seconds)  # fmt: skip
        result = autotune(
            layer,
            settings.max_rank,
            budget_s=settings.kernel_autotune_seconds,
            num_slots=settings.num_slots,
            jobs=min(8, os.cpu_count() or 1),
            log=lambda line: log_event(log, "kernel_autotune_progress", detail=line),
        )
        targets = [settings.max_rank]
        if _untuned(selector.source(shape, 0)):
            targets.append(0)  # the base model shares the tuned tiles
        for rank in targets:
            cache.store(selector.gpu, shape, rank, result.configs)
            selector.add(shape, rank, result.configs)
            seconds[rank] = result.seconds
    reports = tuple(
        KernelConfigReport(rank, selector.source(shape, rank), shape.key, seconds[rank])
        for rank in (settings.max_rank, 0)
    )
    for report in reports:
        seconds_taken = round(report.autotune_seconds, 1)
        log_event(log, "kernel_configs", rank=report.rank, source=report.source,
                  shape=report.shape, autotune_seconds=seconds_taken)  # fmt: skip
    return KernelConfigs(selector, reports)
