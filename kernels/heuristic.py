"""A launch configuration for shapes nobody tuned, from the rows each expert gets.

Fitted on the tuned tables (``kernels/configs/*.json``) and on what start-up autotuning chose
for the shape zoo of ``python -m kernels.bench --zoo`` on an H100 (kernels/BENCHMARKS.md), per
regime of rows per expert (``M * k / E``), written as rules. The regimes:

* about one row per expert (decode): weight streaming. Narrow tiles, one per program, so every
  SM keeps loading; deeper K steps for wide H; the w2 shrink fused into its main loop (the
  separate launch would be a few serial K loops); with a handful of pairs the alignment folded
  into the GEMMs (``MoEConfig.decode``) and both shrinks fused.
* up to ~40 rows: still streaming, BLOCK_M 16 or 32 (the tables' rows at 32–34 rows per
  expert stream in 7 of 9; at 48, DeepSeek-V2-Lite M = 512 on an H200, the compute tiles
  were 1.43× faster).
* beyond: tensor-core bound. 64- then 128-row blocks with wide tiles, one tile per program,
  and a grouped launch order (a block's N tiles together, so its gathered rows stay in L2) for
  many-expert layers; with few experts many blocks share each weight tile, so block index
  fastest.

FP8 experts (fitted on the H200 table's tuned FP8 rows) take wider streaming tiles, narrower
compute tiles in 128-row blocks, and dequantise each weight tile. While each expert gets a
row or two both LoRA shrinks run apart, in K parts (decode steps too): the fused shrink
re-reads x·Aᵀ's input once per N program and a separate one in a single part runs each pair
serially over K, both of which FP8's halved weight bytes leave exposed (start-up autotuning
of OLMoE chose the same).
"""

from __future__ import annotations

import dataclasses

from kernels.configs import GemmConfig, MoEConfig, fit_stages


def _streaming(num_tokens: int, hidden: int, inter: int, rows_per_expert: float) -> MoEConfig:
    wide_k = hidden >= 4096
    if wide_k and inter <= 2048 and num_tokens >= 2:
        # Wide H, narrow experts (DeepSeek-V3, Qwen3-235B): wider N tiles, fewer programs.
        w13 = GemmConfig(block_n=64, block_k=128, tiles_per_program=1, num_warps=4, num_stages=4)
    else:
        w13 = GemmConfig(
            block_n=16 if inter >= 2048 or rows_per_expert <= 1 else 32,
            block_k=256 if wide_k else 128,
            tiles_per_program=1,
            num_warps=4,
            num_stages=3 if wide_k else 4,
        )
    if hidden >= 2880 and inter <= 2880 and rows_per_expert >= 1:
        # Many output columns, a short K: wide w2 tiles (GPT-OSS-120B, DeepSeek-V3 from M=32).
        w2 = GemmConfig(block_n=128, block_k=128, tiles_per_program=1, num_warps=4, num_stages=3)
    else:
        w2 = GemmConfig(
            block_n=32 if inter >= 8192 else 64,
            block_k=256 if inter >= 8192 else 128,
            tiles_per_program=1,
            num_warps=4,
            num_stages=3 if inter >= 8192 else 4,
            fused_shrink=rows_per_expert <= 1,
        )
    return MoEConfig(
        block_m=16 if rows_per_expert <= 12 else 32,
        lora_segments=2 if rows_per_expert <= 1 else 4,
        w13=w13,
        w2=w2,
    )


def decode_pays(num_tokens: int, num_experts: int, top_k: int) -> bool:
    """Few pairs, most on experts of their own: no block would share a weight tile."""
    return num_tokens * top_k <= max(top_k, num_experts // 4)


def _compute(num_experts: int, rows_per_expert: float) -> MoEConfig:
    group_m = 1 if num_experts >= 64 else (8 if num_experts >= 16 else 0)
    # From ~128 rows per expert the 128-row blocks won on every zoo shape but GPT-OSS-120B.
    # w13 through TMA won or tied on every shape measured at M = 512 and 4096 (H100); w2
    # through TMA lost on some (kernels/BENCHMARKS.md), so only autotuning turns it on.
    if rows_per_expert < 128:
        return MoEConfig(
            block_m=64,
            lora_segments=4,
            w13=GemmConfig(64, 64, 1, 4, 4, group_m, tma=True),
            w2=GemmConfig(128, 64, 1, 4, 4, group_m),
        )
    return MoEConfig(
        block_m=128,
        lora_segments=4,
        w13=GemmConfig(128, 64, 1, 8, 3, group_m, tma=True),
        w2=GemmConfig(256, 64, 1, 8, 3, group_m),
    )


#: Rows per expert up to which the GEMMs stream weights (BLOCK_M 16 or 32).
STREAMING_ROWS = 40
#: FP8 experts with at most this many rows per expert run each LoRA shrink apart, in
#: ``FP8_SHRINK_PARTS`` K parts (measured up to M = 8 on six shapes, H200: 1.11–1.89× at
#: M = 1 over both fused, 1.01–1.15× at M = 4 and 8 over one part).
FP8_SPLIT_SHRINK_ROWS = 2
FP8_SHRINK_PARTS = 8

#: FP8 experts streaming weights beyond a decode step (``MoEConfig.decode``): the tiles the
#: tuner chose at M = 8 and 64 on the Qwen3-30B-A3B, Mixtral-8x7B and GPT-OSS-20B-like shapes
#: (and at M = 512 on Qwen3; H200 table), each weight tile dequantised: wider than bf16's, a
#: weight being one byte. The heuristic's earlier FP8 tiles were 17–23% slower at M = 8.
FP8_STREAMING_W13 = GemmConfig(64, 128, 1, 4, 4)
FP8_STREAMING_W2 = GemmConfig(128, 128, 1, 4, 4)
#: FP8 experts in 128-row blocks: the tiles the tuner chose at M = 4096 on five FP8 shapes of
#: the H200 table (Qwen3-30B-A3B, Mixtral-8x7B, GPT-OSS-20B-like, Qwen1.5-MoE-A2.7B,
#: Llama-4-Scout-like) and kept on the four searched from them (Qwen3-235B-A22B,
#: Mixtral-8x22B, GPT-OSS-120B, DeepSeek-V3), narrower than bf16's 8-warp 128×256 tiles, with
#: which the W8A16 loops measured 1.12–1.18× slower (Qwen1.5-MoE, Scout: the tuner's timings).
FP8_COMPUTE_W13 = GemmConfig(64, 64, 1, 4, 4)
FP8_COMPUTE_W2 = GemmConfig(128, 64, 1, 4, 4)


def heuristic_config(
    num_tokens: int,
    num_experts: int,
    hidden: int,
    inter: int,
    top_k: int,
    elem_size: int = 2,
    *,
    fp8: bool = False,
) -> MoEConfig:
    """A reasonable configuration for a shape nobody tuned; ``elem_size``: bytes of the
    hidden states' dtype; ``fp8``: FP8 experts (``fit_stages``)."""
    rows_per_expert = num_tokens * top_k / num_experts
    if rows_per_expert <= STREAMING_ROWS:
        config = _streaming(num_tokens, hidden, inter, rows_per_expert)
    else:
        config = _compute(num_experts, rows_per_expert)
    # Scalar fp32 atomics cost more than the (T*k, H) round trip once there are millions.
    config = dataclasses.replace(config, atomic_sum=num_tokens * top_k * hidden <= (1 << 22))
    decode = decode_pays(num_tokens, num_experts, top_k)
    if decode:
        # One row per block: a separate shrink launch would cost more than it saves (bf16).
        config = dataclasses.replace(config.each_gemm(fused_shrink=True), decode=True)
    if fp8:
        if not decode and rows_per_expert <= STREAMING_ROWS:
            config = dataclasses.replace(config, w13=FP8_STREAMING_W13, w2=FP8_STREAMING_W2)
        elif config.block_m == 128:
            group_m = config.w13.group_m
            config = dataclasses.replace(
                config,
                w13=dataclasses.replace(FP8_COMPUTE_W13, group_m=group_m),
                w2=dataclasses.replace(FP8_COMPUTE_W2, group_m=group_m),
            )
        if rows_per_expert <= FP8_SPLIT_SHRINK_ROWS:
            config = config.each_gemm(fused_shrink=False, shrink_split_k=FP8_SHRINK_PARTS)
        config = config.each_gemm(fp8_dequant=True)
    return fit_stages(config, elem_size, fp8=fp8)
