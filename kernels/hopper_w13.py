"""w13 of the MoE layer on Hopper: a warp-specialised, persistent TMA + wgmma GEMM, in Gluon.

The same stage as ``kernels.fused_moe.w13_stage`` (its torch reference:
``kernels.reference.moe_forward_reference``'s first GEMM and activation), for large batches
on sm_90: for every aligned row of ``kernels.align`` (pair p of token t on expert e)

    g, u = x[t] W13[e]ᵀ (+ b13[e]) + B13[s, e] xa[row]   (gate: W13's rows 0..I, up: I..2I)
    a[row] = act(g, u)                                     (SiLU·up, or GPT-OSS's clamped form)

stored as the (max_rows, I) activation in the aligned row order that w2 reads.

The copy engine cannot gather rows by token on Hopper, so ``gather_rows`` first lays x out
in the aligned row order (padding rows zero); then a warp-specialised, persistent TMA + wgmma
kernel (``kernels.hopper_gemm`` says how and why): the loader streams each stage's x tile and
its gate and up W13 tiles, the compute warpgroups issue a wgmma per half into two accumulators
(gate and up columns of the same intermediate index sit in the same thread, so the
activation needs no data movement) and run the epilogue: the LoRA expand of each half, biases,
the activation, and the store through a layout that writes whole rows.

Shapes and dtypes: x (T, H) bf16/fp16; w13 (E, 2I, H) the same dtype, H and I multiples of 8
(16-byte TMA rows), or FP8 (e4m3, H and I multiples of 64) with its 128×128 block scales, x
then quantised per row and 128 columns (``kernels.fp8_activations``) and gathered with its
scales (W8A8: ``kernels.hopper_gemm`` says how a step is scaled); xa (max_rows, RP) from the
LoRA shrink, in x's dtype or float32; LoRA B13 (S, E, 2I, R); b13 (E, 2I); out (max_rows, I) in
x's dtype. No FP8 weights beside 16-bit inputs (W8A16), no pair blocks: those take the Triton
kernel (``kernels.fused_moe``), which also runs everywhere else (other GPUs, the CPU
interpreter).
"""

# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (Gluon and Triton kernels take untyped pointer, descriptor and constexpr arguments.) No
# `from __future__ import annotations`: Gluon's aggregates read their field annotations as types.

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.language.core import _aggregate as aggregate

from kernels.align import Alignment
from kernels.fp8_activations import quantize_activations
from kernels.hopper_gemm import (
    BLOCK_K,
    FP8_BLOCK_K,
    FP8_BUFFERS,
    GROUP_M,
    LOADER_REGISTERS,
    LOADER_WARPS,
    NUM_BUFFERS,
    NUM_WARPS,
    PINGPONG_BUFFERS,
    PINGPONG_REGISTERS,
    PINGPONG_WARPS,
    FP8Scales,
    KernelLaunch,
    LaunchLoRA,
    LoRAExpand,
    Scalar,
    fp8_scale_args,
    fp8_step_scale,
    invalidate_barriers,
    invalidate_turn_barriers,
    lora_expand_pair,
    scalar,
    stage_barriers,
    tile_of,
    tma_operands,
    turn_barriers,
    wait_for_turn,
)
from kernels.types import Activation

#: Intermediate columns per tile: that many gate and that many up rows of W13 (256 output
#: columns in all, as w2's tile); the rest of the launch configuration is
#: ``kernels.hopper_gemm``'s.
BLOCK_I = 128
#: With FP8 weights 64 (two accumulators and each step's two products fit the registers; a
#: tile lies in one 128-row scale block).
FP8_BLOCK_I = 64
#: Ping-pong 64 as well (one warpgroup holds both accumulators).
PINGPONG_BLOCK_I = 64
_GATHER_BLOCK_H = 1024  # columns each program of gather_rows copies


@triton.jit
def _gather_rows_kernel(
    x_ptr,  # (T, H)
    pair_ids_ptr,  # (max_rows,) int32, -1 for padding
    block_experts_ptr,  # (max_blocks,) int32, -1 past the last block
    out_ptr,  # (max_rows, H)
    H,
    top_k,
    stride_x,
    stride_out,
    BLOCK_M: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """out[row] = x[pair // top_k] for the rows of used blocks, zeros for their padding rows;
    rows of unused blocks (unwritten by the alignment) are left alone: nothing reads them."""
    row = tl.program_id(0)
    if tl.load(block_experts_ptr + row // BLOCK_M) >= 0:
        pair = tl.load(pair_ids_ptr + row)
        cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        token = (tl.maximum(pair, 0) // top_k).to(tl.int64)
        values = tl.load(x_ptr + token * stride_x + cols, mask=(cols < H) & (pair >= 0), other=0.0)
        tl.store(out_ptr + row.to(tl.int64) * stride_out + cols, values, mask=cols < H)


def gather_rows(x: torch.Tensor, alignment: Alignment, top_k: int) -> torch.Tensor:
    """x (T, H) laid out in the aligned row order: (max_rows, H), row r = x[pair(r) // top_k],
    zeros in padding rows (rows of unused blocks unwritten)."""
    rows = alignment.max_blocks * alignment.block_m
    out = torch.empty((rows, x.shape[1]), dtype=x.dtype, device=x.device)
    _gather_rows_kernel[(rows, triton.cdiv(x.shape[1], _GATHER_BLOCK_H))](
        x, alignment.sorted_pair_ids, alignment.block_experts, out, x.shape[1], top_k,
        x.stride(0), out.stride(0), BLOCK_M=alignment.block_m, BLOCK_H=_GATHER_BLOCK_H,
    )  # fmt: skip
    return out


def gather_rows_reference(x: torch.Tensor, alignment: Alignment, top_k: int) -> torch.Tensor:
    """``gather_rows`` in torch; rows of unused blocks zero (the kernel leaves them unwritten)."""
    rows = alignment.max_blocks * alignment.block_m
    used = (alignment.block_experts >= 0).repeat_interleave(alignment.block_m)[:rows]
    pair = torch.where(used, alignment.sorted_pair_ids[:rows], -1).long()
    out = x[pair.clamp(min=0) // top_k]
    return torch.where((pair >= 0)[:, None], out, torch.zeros_like(out))


@aggregate
class _W13Args:
    """What both roles of a program read: descriptors, stage buffers and barriers, sizes."""

    x_desc: tma.tensor_descriptor
    w_desc: tma.tensor_descriptor
    x_bufs: gl.shared_memory_descriptor
    gate_bufs: gl.shared_memory_descriptor
    up_bufs: gl.shared_memory_descriptor
    ready: gl.shared_memory_descriptor
    empty: gl.shared_memory_descriptor
    block_experts_ptr: gl.tensor
    num_blocks: Scalar
    H: Scalar
    inter: Scalar

    @gluon.constexpr_function
    def __init__(
        self, x_desc, w_desc, x_bufs, gate_bufs, up_bufs, ready, empty, block_experts_ptr,
        num_blocks, H, inter,
    ):  # fmt: skip
        self.x_desc = x_desc
        self.w_desc = w_desc
        self.x_bufs = x_bufs
        self.gate_bufs = gate_bufs
        self.up_bufs = up_bufs
        self.ready = ready
        self.empty = empty
        self.block_experts_ptr = block_experts_ptr
        self.num_blocks = scalar(num_blocks)
        self.H = scalar(H)
        self.inter = scalar(inter)


@aggregate
class _Epilogue:
    """What the compute role's epilogue reads besides the accumulators and the LoRA."""

    bias_ptr: gl.tensor
    out_ptr: gl.tensor
    alpha: gl.tensor
    limit: gl.tensor
    stride_bias: Scalar
    stride_out: Scalar

    @gluon.constexpr_function
    def __init__(self, bias_ptr, out_ptr, alpha, limit, stride_bias, stride_out):
        self.bias_ptr = bias_ptr
        self.out_ptr = out_ptr
        self.alpha = alpha
        self.limit = limit
        self.stride_bias = scalar(stride_bias)
        self.stride_out = scalar(stride_out)


@gluon.jit
def _loader(
    p: _W13Args, BM: gl.constexpr, BI: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr
):
    """The loader warp: every K step of every tile of this program, in order, into the stages:
    the rows' x tile, W13's gate rows n0.. and up rows I + n0.. of the tile."""
    num_n = gl.cdiv(p.inter, BI)
    stage_bytes: gl.constexpr = (BM + 2 * BI) * BK * p.x_desc.dtype.primitive_bitwidth // 8
    count = 0
    for item in range(gl.program_id(0), p.num_blocks * num_n, gl.num_programs(0)):
        block, n_tile = tile_of(item, p.num_blocks, num_n, GROUP_M)
        expert = gl.load(p.block_experts_ptr + block)
        if expert >= 0:  # else a padding block: no work
            gate_row = expert * 2 * p.inter + n_tile * BI
            for k in range(0, p.H, BK):
                stage = count % STAGES
                # A fresh barrier's "previous phase" counts as complete: the first pass
                # over the stages does not wait.
                mbarrier.wait(p.empty.index(stage), ((count // STAGES) & 1) ^ 1)
                bar = p.ready.index(stage)
                mbarrier.expect(bar, stage_bytes)
                tma.async_copy_global_to_shared(
                    p.x_desc, [block * BM, k], bar, p.x_bufs.index(stage)
                )
                tma.async_copy_global_to_shared(
                    p.w_desc, [gate_row, k], bar, p.gate_bufs.index(stage)
                )
                tma.async_copy_global_to_shared(
                    p.w_desc, [gate_row + p.inter, k], bar, p.up_bufs.index(stage)
                )
                count += 1


@gluon.jit
def _sigmoid(x):
    return 1.0 / (1.0 + gl.exp(-x))


@gluon.jit
def _tile(
    p: _W13Args,
    e: _Epilogue,
    lora: LoRAExpand,
    scales: FP8Scales,
    block,
    n_tile,
    expert,
    count,
    FP8: gl.constexpr,
    ACTIVATION: gl.constexpr,  # 0 silu, 1 gpt_oss
    HAS_BIAS: gl.constexpr,
    HAS_LORA: gl.constexpr,
    BM: gl.constexpr,
    BI: gl.constexpr,
    BK: gl.constexpr,
    STAGES: gl.constexpr,
    RP: gl.constexpr,
    num_warps: gl.constexpr,
    order=None,
    ROLE: gl.constexpr = 0,
    turn=0,
):
    """One tile on the compute warpgroups: the main loop's wgmmas (gate and up) over the
    stages from ``count`` on, then the epilogue; returns the stage count after it. With
    ``order`` (the ping-pong barriers of ``_compute``'s two roles) the main loop waits for
    role ``ROLE``'s ``turn``-th turn and hands the tensor cores to the other role before the
    epilogue."""
    lora_dtype: gl.constexpr = lora.b_ptr.dtype.element_ty
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1],
        instr_shape=[16, BI, 256 // p.x_desc.dtype.primitive_bitwidth],
    )  # fmt: skip
    # Stores: each warp writes whole 16-byte pieces of rows.
    store_layout: gl.constexpr = gl.BlockedLayout(
        [1, 8], [32 * 8 // BI, BI // 8], [num_warps, 1], [1, 0]
    )
    mma_rows: gl.constexpr = gl.SliceLayout(1, mma)
    mma_cols: gl.constexpr = gl.SliceLayout(0, mma)
    expert64 = expert.to(gl.int64)
    gate = gl.zeros([BM, BI], gl.float32, layout=mma)
    up = gl.zeros([BM, BI], gl.float32, layout=mma)
    if FP8:
        rows = block * BM + gl.arange(0, BM, layout=mma_rows)
        for k in range(0, p.H, BK):
            stage = count % STAGES
            mbarrier.wait(p.ready.index(stage), (count // STAGES) & 1)
            x = p.x_bufs.index(stage)
            gate_part = warpgroup_mma(
                x, p.gate_bufs.index(stage).permute((1, 0)), gate, use_acc=False,
                is_async=True,
            )  # fmt: skip
            up_part = warpgroup_mma(
                x, p.up_bufs.index(stage).permute((1, 0)), up, use_acc=False,
                is_async=True,
            )  # fmt: skip
            gate_scale = fp8_step_scale(scales, rows, expert64, n_tile * BI, k)
            up_scale = fp8_step_scale(scales, rows, expert64, p.inter + n_tile * BI, k)
            # The step's products are scaled before they join the sums: wait for them.
            gate_part, up_part = warpgroup_mma_wait(0, deps=(gate_part, up_part))
            mbarrier.arrive(p.empty.index(stage))
            gate += gate_part * gate_scale[:, None]
            up += up_part * up_scale[:, None]
            count += 1
    else:
        if order is not None:
            wait_for_turn(order, ROLE, turn)
        for k in range(0, p.H, BK):
            stage = count % STAGES
            mbarrier.wait(p.ready.index(stage), (count // STAGES) & 1)
            x = p.x_bufs.index(stage)
            gate = warpgroup_mma(x, p.gate_bufs.index(stage).permute((1, 0)), gate, is_async=True)
            up = warpgroup_mma(x, p.up_bufs.index(stage).permute((1, 0)), up, is_async=True)
            # This stage's two wgmmas stay in flight; the stage before has been read.
            gate, up = warpgroup_mma_wait(2, deps=(gate, up))
            mbarrier.arrive(p.empty.index((count + STAGES - 1) % STAGES), pred=k > 0)
            count += 1
        gate, up = warpgroup_mma_wait(0, deps=(gate, up))
        mbarrier.arrive(p.empty.index((count + STAGES - 1) % STAGES))
        if order is not None:
            mbarrier.arrive(order.index(1 - ROLE))  # the other role's turn

    # Computed after the main loop: nothing more stays alive through it.
    rows = block * BM + gl.arange(0, BM, layout=mma_rows)
    cols = n_tile * BI + gl.arange(0, BI, layout=mma_cols)
    real = cols < p.inter
    if HAS_LORA:
        gate, up = lora_expand_pair(
            gate, up, lora, expert64, rows, cols, cols + p.inter, real,
            lora_dtype, BM, BI, RP, num_warps,
        )  # fmt: skip
    if HAS_BIAS:
        bias = e.bias_ptr + expert64 * e.stride_bias + cols
        gate += gl.load(bias, mask=real, other=0.0).to(gl.float32)[None, :]
        up += gl.load(bias + p.inter, mask=real, other=0.0).to(gl.float32)[None, :]
    if ACTIVATION == 0:
        act = gate * _sigmoid(gate) * up
    else:
        gate = gl.minimum(gate, e.limit)
        up = gl.minimum(gl.maximum(up, -e.limit), e.limit)
        act = (up + 1.0) * gate * _sigmoid(e.alpha * gate)

    srows = block * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, store_layout))
    scols = n_tile * BI + gl.arange(0, BI, layout=gl.SliceLayout(0, store_layout))
    y = gl.convert_layout(act.to(e.out_ptr.dtype.element_ty), store_layout)
    out = e.out_ptr + srows.to(gl.int64)[:, None] * e.stride_out + scols[None, :]
    gl.store(out, y, mask=(scols < p.inter)[None, :])
    return count


@gluon.jit
def _compute(
    p: _W13Args,
    e: _Epilogue,
    lora: LoRAExpand,
    scales: FP8Scales,
    order,
    FP8: gl.constexpr,
    ACTIVATION: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    HAS_LORA: gl.constexpr,
    BM: gl.constexpr,
    BI: gl.constexpr,
    BK: gl.constexpr,
    STAGES: gl.constexpr,
    RP: gl.constexpr,
    num_warps: gl.constexpr,
    ROLE: gl.constexpr = 0,
    ROLES: gl.constexpr = 1,
):
    """A compute role over the tiles of the program: with one role the compute warpgroups
    together on every tile; with two (ping-pong, ``order`` their barriers,
    ``kernels.hopper_gemm``) the warpgroup of role ``ROLE`` on every other tile, its stages in
    the one ring, the other role's tiles only advancing the stage count."""
    num_n = gl.cdiv(p.inter, BI)
    count = 0
    owned = 0
    for item in range(gl.program_id(0), p.num_blocks * num_n, gl.num_programs(0)):
        block, n_tile = tile_of(item, p.num_blocks, num_n, GROUP_M)
        expert = gl.load(p.block_experts_ptr + block)
        if expert >= 0:
            if owned % ROLES == ROLE:
                count = _tile(
                    p, e, lora, scales, block, n_tile, expert, count, FP8, ACTIVATION,
                    HAS_BIAS, HAS_LORA, BM, BI, BK, STAGES, RP, num_warps, order, ROLE,
                    owned // ROLES,
                )  # fmt: skip
            else:
                count += gl.cdiv(p.H, BK)  # the other role's stages
            owned += 1


@gluon.jit
def _w13_hopper_kernel(
    x_desc,  # the gathered rows (max_rows, H), block (BM, BK)
    w_desc,  # W13 seen as (E*2I, H), block (BI, BK)
    xa_ptr,  # (max_rows, RP) x·A13ᵀ from the shrink launch, or unused
    b_ptr,  # (S, E, 2I, R) LoRA B13, or unused
    bias_ptr,  # (E, 2I), or unused
    out_ptr,  # (max_rows, I) activation, aligned row order
    row_slots_ptr,  # (max_rows,) int32, -1 for no adapter, or unused
    block_experts_ptr,  # (max_blocks,) int32, -1 past the last block
    xs_ptr,  # FP8: (max_rows, ceil(H/128)) float32 scales of the rows' groups; else unused
    ws_ptr,  # FP8: (E, ceil(2I/128), ceil(H/128)) float32 block scales of W13; else unused
    num_blocks,
    H,
    inter,
    R,
    alpha,
    limit,
    stride_xa,
    stride_bs,
    stride_be,
    stride_bn,
    stride_br,
    stride_bias,
    stride_out,
    stride_xs,
    stride_wse,
    stride_wsn,
    FP8: gl.constexpr,
    ACTIVATION: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    HAS_LORA: gl.constexpr,
    RP: gl.constexpr,
    STAGES: gl.constexpr,
    PINGPONG: gl.constexpr,  # two compute roles taking turns (16-bit only; num_warps 4)
    LOADER_WARPS: gl.constexpr,
    LOADER_REGISTERS: gl.constexpr,
    num_warps: gl.constexpr,
):
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    BI: gl.constexpr = w_desc.block_type.shape[0]
    dtype: gl.constexpr = x_desc.dtype
    x_bufs = gl.allocate_shared_memory(dtype, [STAGES, BM, BK], x_desc.layout)
    gate_bufs = gl.allocate_shared_memory(dtype, [STAGES, BI, BK], w_desc.layout)
    up_bufs = gl.allocate_shared_memory(dtype, [STAGES, BI, BK], w_desc.layout)
    ready, empty = stage_barriers(STAGES)
    p = _W13Args(
        x_desc, w_desc, x_bufs, gate_bufs, up_bufs, ready, empty, block_experts_ptr, num_blocks,
        H, inter,
    )  # fmt: skip
    e = _Epilogue(bias_ptr, out_ptr, alpha, limit, stride_bias, stride_out)
    lora = LoRAExpand(
        xa_ptr, b_ptr, row_slots_ptr, R, stride_xa, stride_bs, stride_be, stride_bn, stride_br
    )
    scales = FP8Scales(xs_ptr, ws_ptr, stride_xs, stride_wse, stride_wsn)
    if PINGPONG:
        order = turn_barriers()
        gl.warp_specialize(
            [
                (
                    _compute,
                    (p, e, lora, scales, order, False, ACTIVATION, HAS_BIAS, HAS_LORA, BM, BI,
                     BK, STAGES, RP, num_warps, 0, 2),
                ),
                (
                    _compute,
                    (p, e, lora, scales, order, False, ACTIVATION, HAS_BIAS, HAS_LORA, BM, BI,
                     BK, STAGES, RP, num_warps, 1, 2),
                ),
                (_loader, (p, BM, BI, BK, STAGES)),
            ],
            [PINGPONG_WARPS, LOADER_WARPS],
            [PINGPONG_REGISTERS, LOADER_REGISTERS],
        )  # fmt: skip
        invalidate_turn_barriers(order)
    else:
        gl.warp_specialize(
            [
                (
                    _compute,
                    (p, e, lora, scales, None, FP8, ACTIVATION, HAS_BIAS, HAS_LORA, BM, BI, BK,
                     STAGES, RP, num_warps),
                ),
                (_loader, (p, BM, BI, BK, STAGES)),
            ],
            [LOADER_WARPS],
            [LOADER_REGISTERS],
        )  # fmt: skip
    invalidate_barriers(ready, empty, STAGES)


def w13_stage_hopper(
    x: torch.Tensor,
    w13: torch.Tensor,
    b13: torch.Tensor | None,
    activation: Activation,
    alpha: float,
    limit: float,
    top_k: int,
    alignment: Alignment,
    xa: torch.Tensor | None,
    lora_b: torch.Tensor | None,
    row_slots: torch.Tensor | None,
    w13_scale: torch.Tensor | None = None,
    pingpong: bool = False,
) -> torch.Tensor:
    """The w13 stage (see the module doc): the (max_rows, I) activation in x's dtype; ``xa``
    (max_rows, RP) from the LoRA shrink and ``lora_b`` (S, E, 2I, R) B13, or both None
    without LoRA; ``w13_scale``: w13 is FP8 with these block scales, and x is quantised for
    the FP8 tensor cores first (its rows' scales gathered with them); ``pingpong``: the
    compute warpgroups take turns (``kernels.hopper_gemm``; 16-bit weights, FP8 runs them
    together)."""
    row_scales = None
    if w13_scale is None:
        rows = gather_rows(x, alignment, top_k)
    else:
        quantised, scales = quantize_activations(x)
        rows = gather_rows(quantised, alignment, top_k)
        row_scales = gather_rows(scales, alignment, top_k)
    out = torch.empty((rows.shape[0], w13.shape[1] // 2), dtype=x.dtype, device=x.device)
    launch = w13_launch(
        rows, w13, b13, activation, alpha, limit, alignment, xa, lora_b, row_slots, out,
        row_scales, w13_scale, pingpong,
    )  # fmt: skip
    launch(x.device)
    return out


def w13_launch(
    rows: torch.Tensor,
    w13: torch.Tensor,
    b13: torch.Tensor | None,
    activation: Activation,
    alpha: float,
    limit: float,
    alignment: Alignment,
    xa: torch.Tensor | None,
    lora_b: torch.Tensor | None,
    row_slots: torch.Tensor | None,
    out: torch.Tensor,
    row_scales: torch.Tensor | None = None,
    w13_scale: torch.Tensor | None = None,
    pingpong: bool = False,
) -> KernelLaunch:
    """The w13 kernel's launch over the gathered ``rows`` (max_rows, H) into ``out``
    (max_rows, I); with FP8 ``rows`` are quantised, their scales ``row_scales``."""
    e, two_i, h = w13.shape
    inter = two_i // 2
    fp8 = w13_scale is not None
    pingpong = pingpong and not fp8
    block_i, block_k = (FP8_BLOCK_I, FP8_BLOCK_K) if fp8 else (BLOCK_I, BLOCK_K)
    if pingpong:
        block_i = PINGPONG_BLOCK_I
    stages = FP8_BUFFERS if fp8 else PINGPONG_BUFFERS if pingpong else NUM_BUFFERS
    x_desc, w_desc = tma_operands(rows, w13.view(e * two_i, h), block_i, block_k)
    lora = LaunchLoRA.of(xa, lora_b, row_slots, out, alignment.sorted_pair_ids)
    bias = b13 if b13 is not None else out
    scale_args = fp8_scale_args(row_scales, w13_scale, out)
    return KernelLaunch(
        _w13_hopper_kernel,
        alignment.max_blocks * triton.cdiv(inter, block_i),
        (
            x_desc, w_desc, lora.xa, lora.b, bias, out, lora.row_slots,
            alignment.block_experts, *scale_args[:2],
            alignment.max_blocks, h, inter, lora.rank, alpha, limit, *lora.strides,
            bias.stride(0), out.stride(0), *scale_args[2:],
        ),
        dict(
            FP8=fp8, ACTIVATION=0 if activation == Activation.SILU else 1,
            HAS_BIAS=b13 is not None, HAS_LORA=lora.on, RP=lora.padded_rank,
            STAGES=stages, PINGPONG=pingpong, LOADER_WARPS=LOADER_WARPS,
            LOADER_REGISTERS=LOADER_REGISTERS,
            num_warps=PINGPONG_WARPS.value if pingpong else NUM_WARPS,
        ),
    )  # fmt: skip
