"""Launch configurations of the fused MoE kernels, in one place.

A configuration is chosen by ``kernels.config_select``: the tuned table of the current GPU
(``kernels/configs/<GPU name>.json``, written by ``python -m kernels.tune``), else configurations
autotuned on this machine (``kernels.config_cache``), else the nearest tuned rank, else
``kernels.heuristic``.

Table format::

    {"E=128,H=2048,I=768,k=8,r=16": {"64": {"block_m": 16, "lora_segments": 4,
                                            "w13": {...GemmConfig...}, "w2": {...}}, ...}}

``r`` is the LoRA slots' rank, 0 for the base model.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from kernels.model_shape import LayerShape
from kernels.types import FP8_BLOCK

CONFIG_DIR = Path(__file__).parent / "configs"


@dataclass(frozen=True)
class GemmConfig:
    """Tiles of one grouped GEMM (w13 or w2).

    block_n: output columns per tile; for w13 that many gate *and* that many up columns.
    block_k: reduction step.
    tiles_per_program: consecutive N tiles each program computes (one after the other).
    group_m: launch order. Programs of ``group_m`` consecutive M blocks (all their N tiles)
        run next to each other, so a block's input rows and an expert's weight tiles are
        reused from L2 while they are there; 0: one group of all blocks (block index fastest).
    fused_shrink: compute the LoRA shrink (x·A[s, e]ᵀ) inside this GEMM's main loop, in each
        program's first tile, from the x tiles already loaded (one more dot per K step), instead
        of in a separate launch before it. Pays where the separate launch has few programs or
        its fixed cost dominates (small M, few experts); each program of a block repeats it,
        so at large M it wants many tiles per program.
    tma: load the weight tiles with the tensor copy engine (a TMA descriptor) where the GPU
        has one (sm_90+); for w13 one box holds the tile's gate rows and its up rows. Elsewhere
        pointer loads, with the same result.
    split_k: w2 only, with ``MoEConfig.atomic_sum``: the reduction over I is cut into this
        many parts, each a program that adds its share into the sum (more programs to stream
        the weights when there are few tiles: decode). Ignored without the atomic sum.
    persistent: launch this many programs per multiprocessor (0: one program per piece of
        work), each looping over the (block, N program) work in the launch order: no program
        launch and retirement per tile, and a program's next tile follows its last at once.
    shrink_split_k: with the shrink not fused, its reduction over K is cut into this many
        parts, each a program that adds its float32 partial sum into x·Aᵀ atomically (a
        decode step otherwise has one program per pair, streaming all of K serially; from
        three parts the order of the additions varies, so the last bit may differ between
        runs).
    fp8_dequant: FP8 weights only: dequantise each weight tile (q·scale, rounded to the
        activations' dtype) and accumulate in the dot, instead of converting the tile exactly
        and scaling each K step's product (a second accumulator's worth of registers).
    fp8_activations: FP8 weights only: quantise this GEMM's input to FP8 (a scale per row and
        128 columns, ``kernels.fp8_activations``; one more launch) and run the FP8 tensor
        cores ("W8A8", the numerics of DeepSeek-V3's reference), the product of each K step
        scaled by its rows' and columns' scales. The LoRA keeps the unquantised input, so it
        takes the separate shrink. Answers differ from the bf16-activation path by the input's
        quantisation (a few 1e-2 relative), not by rounding only.
    hopper: on an sm_90 GPU, with bf16/fp16 weights, aligned blocks of
        ``kernels.hopper_gemm.BLOCK_M`` rows and LoRA ranks up to its ``MAX_RANK``, run this
        GEMM on its warp-specialised TMA + wgmma kernel (``kernels.hopper_w13``,
        ``kernels.hopper_w2``; their own tiles: this configuration's tile fields are unused;
        the LoRA takes the separate shrink); FP8 weights only with ``fp8_activations`` (their
        FP8 main loop). Anything else (other GPUs, the interpreter, W8A16, pair blocks) runs
        the Triton kernel with this configuration as if it were off.
    pingpong: with ``hopper`` and 16-bit weights, the Hopper kernel's two compute
        warpgroups take turns on tiles half as wide (``kernels.hopper_gemm``: each one's
        epilogue beside the other's main loop) instead of sharing each tile; FP8 runs them
        together. Same answers, bit for bit.
    """

    block_n: int
    block_k: int
    tiles_per_program: int
    num_warps: int
    num_stages: int
    group_m: int = 0
    fused_shrink: bool = False
    tma: bool = False
    split_k: int = 1
    persistent: int = 0
    shrink_split_k: int = 1
    fp8_dequant: bool = False
    fp8_activations: bool = False
    hopper: bool = False
    pingpong: bool = False


@dataclass(frozen=True)
class MoEConfig:
    """block_m: rows (pairs) per block, shared by both GEMMs since they share the alignment.
    lora_segments: adapter slots a block's LoRA handles in one stacked dot; blocks holding more
        take extra passes (correct, slower).
    atomic_sum: w2 adds each pair's weighted output into a float32 (T, H) buffer with atomics
        (no (T*k, H) round trip through memory; the order of the k additions varies, so for
        k > 2 the last bit may differ between runs); else w2 stores one row per pair and a
        separate pass sums the k rows in a fixed order (deterministic).
    decode: fold the alignment into the GEMMs: every (token, expert) pair is a 16-row block of
        its own, its expert read straight from topk_ids (``kernels.align.pair_blocks``), so a
        decode step with a handful of pairs launches no alignment; block_m is then unused.
    """

    block_m: int
    lora_segments: int
    w13: GemmConfig
    w2: GemmConfig
    atomic_sum: bool = True
    decode: bool = False

    def each_gemm(self, **changes: Any) -> MoEConfig:
        """This configuration with ``changes`` made to both GEMMs' ``GemmConfig``."""
        return dataclasses.replace(
            self,
            w13=dataclasses.replace(self.w13, **changes),
            w2=dataclasses.replace(self.w2, **changes),
        )

    def to_json(self) -> dict[str, Any]:
        """The fields, less those at their defaults (``from_json`` restores them)."""
        data = _without_defaults(self)
        data["w13"], data["w2"] = _without_defaults(self.w13), _without_defaults(self.w2)
        return data

    @staticmethod
    def from_json(data: dict[str, Any]) -> MoEConfig:
        return MoEConfig(
            block_m=data["block_m"],
            lora_segments=data["lora_segments"],
            w13=GemmConfig(**data["w13"]),
            w2=GemmConfig(**data["w2"]),
            atomic_sum=data.get("atomic_sum", True),
            decode=data.get("decode", False),
        )


def _without_defaults(config: MoEConfig | GemmConfig) -> dict[str, Any]:
    defaults = {f.name: f.default for f in dataclasses.fields(config)}
    return {k: v for k, v in asdict(config).items() if defaults[k] != v}


def table_key(shape: LayerShape, rank: int) -> str:
    """The key of a (shape, rank) row of a tuned table: ``E=…,H=…,I=…,k=…[,weights=fp8],r=…``."""
    return f"{shape.key},r={rank}"


def parse_table_key(key: str) -> tuple[LayerShape, int]:
    """The (shape, rank) of a ``table_key``."""
    fields = dict(part.split("=") for part in key.split(","))
    experts, hidden, inter, top_k, rank = (int(fields[name]) for name in ("E", "H", "I", "k", "r"))
    return LayerShape(experts, hidden, inter, top_k, fp8=fields.get("weights") == "fp8"), rank


def device_name(device: torch.device) -> str:
    """File-name-safe GPU name, e.g. ``NVIDIA_H100_80GB_HBM3``; ``cpu`` off the GPU."""
    if device.type != "cuda":
        return "cpu"
    return _cuda_device_name(device.index if device.index is not None else 0)


@functools.cache
def _cuda_device_name(index: int) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", torch.cuda.get_device_name(index)).strip("_")


def config_path(name: str) -> Path:
    return CONFIG_DIR / f"{name}.json"


@functools.cache
def load_table(name: str) -> dict[str, dict[int, MoEConfig]]:
    """The tuned table of one GPU (cached per GPU name; empty when there is none)."""
    path = config_path(name)
    if not path.exists():
        return {}
    raw = json.loads(path.read_text())
    return {
        shape: {int(m): MoEConfig.from_json(cfg) for m, cfg in by_m.items()}
        for shape, by_m in raw.items()
    }


#: Widest stacked LoRA A operand (segments × padded rank) of a shrink fused into a main loop:
#: bounds the registers and shared memory it adds to a tile.
STACK_WIDTH = 64


def segments_per_pass(lora_segments: int, padded_rank: int) -> int:
    """Segments (adapter slots) of a block that a fused shrink's stacked dot handles."""
    return max(1, min(lora_segments, STACK_WIDTH // padded_rank))


def padded_rank(rank: int) -> int:
    """The rank as the kernels pad it: a power of two, at least 16 (tl.dot's minimum)."""
    return max(1 << (max(rank, 1) - 1).bit_length(), 16)


#: Shared memory the main loops' pipeline stages may take (H100/H200: 227 KB per block),
#: leaving room for the epilogue's layout conversions.
SMEM_BUDGET = 160 * 1024


#: Largest padded LoRA rank a fused shrink holds in registers (and the rank step of the
#: separate shrink and the expand).
MAX_REGISTER_RANK = 64


def _fit_fp8(gemm: GemmConfig) -> GemmConfig:
    """FP8 weights: pointer loads (the FP8 main loops have no TMA path), a K step that lies
    in one 128-wide scale block (block_k, a power of two, at most 128), and with FP8
    activations the separate shrink (the LoRA reads the unquantised input)."""
    return dataclasses.replace(
        gemm,
        tma=False,
        block_k=min(gemm.block_k, FP8_BLOCK),
        fused_shrink=gemm.fused_shrink and not gemm.fp8_activations,
    )


def fit_stages(
    config: MoEConfig, elem_size: int, lora_rank: int = 16, *, fp8: bool = False
) -> MoEConfig:
    """Fit a configuration to the LoRA rank and dtypes: ranks above ``MAX_REGISTER_RANK``
    take the separate shrink, FP8 experts (``fp8``) take ``_fit_fp8``'s tiles, and num_stages
    is lowered where the operand tiles would not fit ``SMEM_BUDGET``: x (and a fused shrink's
    stacked A) of ``elem_size``-byte elements (the hidden states' dtype, fp32: 4; FP8
    activations: one), weights of as many bytes, FP8 of one."""
    if fp8:
        config = dataclasses.replace(config, w13=_fit_fp8(config.w13), w2=_fit_fp8(config.w2))
    rp = padded_rank(lora_rank)
    if rp > MAX_REGISTER_RANK:
        config = config.each_gemm(fused_shrink=False)
    lora_cols = segments_per_pass(config.lora_segments, rp) * rp
    weight_size = 1 if fp8 else elem_size

    def fit(gemm: GemmConfig, tile_rows: int) -> GemmConfig:
        lora_rows = lora_cols if gemm.fused_shrink else 0
        x_size = 1 if fp8 and gemm.fp8_activations else elem_size
        per_stage = (
            config.block_m * x_size + lora_rows * elem_size + tile_rows * weight_size
        ) * gemm.block_k
        stages = max(2, min(gemm.num_stages, SMEM_BUDGET // per_stage))
        return dataclasses.replace(gemm, num_stages=stages)

    return dataclasses.replace(
        config, w13=fit(config.w13, 2 * config.w13.block_n), w2=fit(config.w2, config.w2.block_n)
    )
