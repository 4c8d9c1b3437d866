"""w2 of the MoE layer on Hopper: a warp-specialised, persistent TMA + wgmma GEMM, in Gluon.

The same stage as ``kernels.fused_moe.w2_stage`` (its torch reference:
``kernels.reference.moe_forward_reference``'s second GEMM), for large batches on sm_90:

    y[p] = w_p · (a[row(p)] W2[e]ᵀ (+ b2[e]) + B2[s, e] xa[row(p)])

over the aligned rows of ``kernels.align`` (BLOCK_M rows of one expert per block), stored one
row per pair (or added into the float32 sum over k with ``atomic_sum``).

A warp-specialised, persistent TMA + wgmma kernel (``kernels.hopper_gemm`` says how and why):
the loader streams (a, W2) tiles, the compute warpgroups issue one wgmma per stage and run
the epilogue: the LoRA expand, bias, routed weight, and the store through a layout that writes
whole rows.

Shapes and dtypes: act (max_rows, I) bf16/fp16, the aligned activation of ``w13_stage``;
w2 (E, H, I) the same dtype, H and I multiples of 8 (16-byte TMA rows), or FP8 (e4m3) with its
128×128 block scales, act then quantised per row and 128 columns first (W8A8); xa
(max_rows, RP) in act's dtype or float32 (a split shrink); LoRA B2 (S, E, H, R); b2 (E, H); out
(T*k, H) in act's dtype, or (T, H) float32 with ``atomic_sum``. No W8A16, no split K, no pair
blocks: those take the Triton kernel (``kernels.fused_moe``), which also runs everywhere else
(other GPUs, the CPU interpreter).
"""

# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (Gluon kernels take untyped descriptor and constexpr arguments.) No `from __future__ import
# annotations`: Gluon's aggregates read their field annotations as types.

import torch
import triton
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
    lora_expand,
    scalar,
    stage_barriers,
    tile_of,
    tma_operands,
    turn_barriers,
    wait_for_turn,
)

#: Output columns per tile (W2 rows): 256, or with FP8 weights 128 (one scale block, and room
#: for each step's product beside the sum), or ping-pong 128 (one warpgroup's accumulator);
#: the rest of the launch configuration is ``kernels.hopper_gemm``'s.
BLOCK_N = 256
FP8_BLOCK_N = 128
PINGPONG_BLOCK_N = 128


@aggregate
class _W2Args:
    """What both roles of a program read: descriptors, stage buffers and barriers, sizes."""

    act_desc: tma.tensor_descriptor
    w_desc: tma.tensor_descriptor
    a_bufs: gl.shared_memory_descriptor
    b_bufs: gl.shared_memory_descriptor
    ready: gl.shared_memory_descriptor
    empty: gl.shared_memory_descriptor
    block_experts_ptr: gl.tensor
    num_blocks: Scalar
    H: Scalar
    inter: Scalar

    @gluon.constexpr_function
    def __init__(
        self, act_desc, w_desc, a_bufs, b_bufs, ready, empty, block_experts_ptr, num_blocks, H,
        inter,
    ):  # fmt: skip
        self.act_desc = act_desc
        self.w_desc = w_desc
        self.a_bufs = a_bufs
        self.b_bufs = b_bufs
        self.ready = ready
        self.empty = empty
        self.block_experts_ptr = block_experts_ptr
        self.num_blocks = scalar(num_blocks)
        self.H = scalar(H)
        self.inter = scalar(inter)


@aggregate
class _Epilogue:
    """What the compute role's epilogue reads besides the accumulator and the LoRA."""

    bias_ptr: gl.tensor
    out_ptr: gl.tensor
    pair_ids_ptr: gl.tensor
    topk_weights_ptr: gl.tensor
    top_k: Scalar
    stride_bias: Scalar
    stride_out: Scalar

    @gluon.constexpr_function
    def __init__(
        self, bias_ptr, out_ptr, pair_ids_ptr, topk_weights_ptr, top_k, stride_bias, stride_out
    ):
        self.bias_ptr = bias_ptr
        self.out_ptr = out_ptr
        self.pair_ids_ptr = pair_ids_ptr
        self.topk_weights_ptr = topk_weights_ptr
        self.top_k = scalar(top_k)
        self.stride_bias = scalar(stride_bias)
        self.stride_out = scalar(stride_out)


@gluon.jit
def _loader(p: _W2Args, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr):
    """The loader warp: every K step of every tile of this program, in order, into the stages."""
    num_n = gl.cdiv(p.H, BN)
    stage_bytes: gl.constexpr = (BM + BN) * BK * p.act_desc.dtype.primitive_bitwidth // 8
    count = 0
    for tile in range(gl.program_id(0), p.num_blocks * num_n, gl.num_programs(0)):
        block, n_tile = tile_of(tile, p.num_blocks, num_n, GROUP_M)
        expert = gl.load(p.block_experts_ptr + block)
        if expert >= 0:  # else a padding block: no work
            w_row = expert * p.H + n_tile * BN
            for k in range(0, p.inter, BK):
                stage = count % STAGES
                # A fresh barrier's "previous phase" counts as complete: the first pass
                # over the stages does not wait.
                mbarrier.wait(p.empty.index(stage), ((count // STAGES) & 1) ^ 1)
                mbarrier.expect(p.ready.index(stage), stage_bytes)
                tma.async_copy_global_to_shared(
                    p.act_desc, [block * BM, k], p.ready.index(stage), p.a_bufs.index(stage)
                )
                tma.async_copy_global_to_shared(
                    p.w_desc, [w_row, k], p.ready.index(stage), p.b_bufs.index(stage)
                )
                count += 1


@gluon.jit
def _tile(
    p: _W2Args,
    e: _Epilogue,
    lora: LoRAExpand,
    scales: FP8Scales,
    block,
    n_tile,
    expert,
    count,
    FP8: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    HAS_LORA: gl.constexpr,
    ATOMIC_SUM: gl.constexpr,
    BM: gl.constexpr,
    BN: gl.constexpr,
    BK: gl.constexpr,
    STAGES: gl.constexpr,
    RP: gl.constexpr,
    num_warps: gl.constexpr,
    order=None,
    ROLE: gl.constexpr = 0,
    turn=0,
):
    """One tile on the compute warpgroups: the main loop's wgmmas over the stages from
    ``count`` on, then the epilogue; returns the stage count after it. With ``order`` (the
    ping-pong barriers of ``_compute``'s two roles) the main loop waits for role ``ROLE``'s
    ``turn``-th turn (``kernels.hopper_gemm.wait_for_turn``) and hands the tensor cores to the
    other role before the epilogue."""
    lora_dtype: gl.constexpr = lora.b_ptr.dtype.element_ty
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1],
        instr_shape=[16, BN, 256 // p.act_desc.dtype.primitive_bitwidth],
    )  # fmt: skip
    # Stores: each warp writes whole 16-byte pieces of rows.
    store_layout: gl.constexpr = gl.BlockedLayout(
        [1, 8], [32 * 8 // BN, BN // 8], [num_warps, 1], [1, 0]
    )
    mma_rows: gl.constexpr = gl.SliceLayout(1, mma)
    mma_cols: gl.constexpr = gl.SliceLayout(0, mma)
    expert64 = expert.to(gl.int64)
    acc = gl.zeros([BM, BN], gl.float32, layout=mma)
    if FP8:
        rows = block * BM + gl.arange(0, BM, layout=mma_rows)
        for k in range(0, p.inter, BK):
            stage = count % STAGES
            mbarrier.wait(p.ready.index(stage), (count // STAGES) & 1)
            part = warpgroup_mma(
                p.a_bufs.index(stage), p.b_bufs.index(stage).permute((1, 0)), acc,
                use_acc=False, is_async=True,
            )  # fmt: skip
            scale = fp8_step_scale(scales, rows, expert64, n_tile * BN, k)
            # The step's product is scaled before it joins the sum: wait for it.
            part = warpgroup_mma_wait(0, deps=(part,))
            mbarrier.arrive(p.empty.index(stage))
            acc += part * scale[:, None]
            count += 1
    else:
        if order is not None:
            wait_for_turn(order, ROLE, turn)
        for k in range(0, p.inter, BK):
            stage = count % STAGES
            mbarrier.wait(p.ready.index(stage), (count // STAGES) & 1)
            acc = warpgroup_mma(
                p.a_bufs.index(stage), p.b_bufs.index(stage).permute((1, 0)), acc,
                is_async=True,
            )  # fmt: skip
            # One wgmma stays in flight; the one before it has read its stage.
            acc = warpgroup_mma_wait(1, deps=(acc,))
            mbarrier.arrive(p.empty.index((count + STAGES - 1) % STAGES), pred=k > 0)
            count += 1
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(p.empty.index((count + STAGES - 1) % STAGES))
        if order is not None:
            mbarrier.arrive(order.index(1 - ROLE))  # the other role's turn

    # Computed after the main loop: nothing more stays alive through it.
    rows = block * BM + gl.arange(0, BM, layout=mma_rows)
    cols = n_tile * BN + gl.arange(0, BN, layout=mma_cols)
    if HAS_LORA:
        acc = lora_expand(
            acc, lora, expert64, rows, cols, cols < p.H, lora_dtype, BM, BN, RP, num_warps
        )
    if HAS_BIAS:
        bias = gl.load(e.bias_ptr + expert64 * e.stride_bias + cols, mask=cols < p.H, other=0.0)
        acc += bias.to(gl.float32)[None, :]
    pair = gl.load(e.pair_ids_ptr + rows)
    weight = gl.load(e.topk_weights_ptr + pair, mask=pair >= 0, other=0.0)
    acc = acc * weight[:, None]

    srows = block * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, store_layout))
    scols = n_tile * BN + gl.arange(0, BN, layout=gl.SliceLayout(0, store_layout))
    spair = gl.load(e.pair_ids_ptr + srows)
    mask = (spair >= 0)[:, None] & (scols < p.H)[None, :]
    if ATOMIC_SUM:
        out_rows = (spair // e.top_k).to(gl.int64) * e.stride_out
        y = gl.convert_layout(acc, store_layout)
        gl.atomic_add(e.out_ptr + out_rows[:, None] + scols[None, :], y, mask=mask, sem="relaxed")
    else:
        out_rows = spair.to(gl.int64) * e.stride_out
        y = gl.convert_layout(acc.to(e.out_ptr.dtype.element_ty), store_layout)
        gl.store(e.out_ptr + out_rows[:, None] + scols[None, :], y, mask=mask)
    return count


@gluon.jit
def _compute(
    p: _W2Args,
    e: _Epilogue,
    lora: LoRAExpand,
    scales: FP8Scales,
    order,
    FP8: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    HAS_LORA: gl.constexpr,
    ATOMIC_SUM: gl.constexpr,
    BM: gl.constexpr,
    BN: gl.constexpr,
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
    num_n = gl.cdiv(p.H, BN)
    count = 0
    owned = 0
    for tile in range(gl.program_id(0), p.num_blocks * num_n, gl.num_programs(0)):
        block, n_tile = tile_of(tile, p.num_blocks, num_n, GROUP_M)
        expert = gl.load(p.block_experts_ptr + block)
        if expert >= 0:
            if owned % ROLES == ROLE:
                count = _tile(
                    p, e, lora, scales, block, n_tile, expert, count, FP8, HAS_BIAS, HAS_LORA,
                    ATOMIC_SUM, BM, BN, BK, STAGES, RP, num_warps, order, ROLE, owned // ROLES,
                )  # fmt: skip
            else:
                count += gl.cdiv(p.inter, BK)  # the other role's stages
            owned += 1


@gluon.jit
def _w2_hopper_kernel(
    act_desc,  # (max_rows, I), block (BM, BK)
    w_desc,  # W2 seen as (E*H, I), block (BN, BK)
    xa_ptr,  # (max_rows, RP) a·A2ᵀ from the shrink launch, or unused
    b_ptr,  # (S, E, H, R) LoRA B2, or unused
    bias_ptr,  # (E, H), or unused
    out_ptr,  # ATOMIC_SUM: (T, H) float32; else (T*k, H), a row per pair
    pair_ids_ptr,  # (max_rows,) int32, -1 for padding
    row_slots_ptr,  # (max_rows,) int32, -1 for no adapter, or unused
    block_experts_ptr,  # (max_blocks,) int32, -1 past the last block
    topk_weights_ptr,  # (T*k,) float32
    xs_ptr,  # FP8: (max_rows, ceil(I/128)) float32 scales of act's row groups; else unused
    ws_ptr,  # FP8: (E, ceil(H/128), ceil(I/128)) float32 block scales of W2; else unused
    num_blocks,
    H,
    inter,
    top_k,
    R,
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
    HAS_BIAS: gl.constexpr,
    HAS_LORA: gl.constexpr,
    ATOMIC_SUM: gl.constexpr,
    RP: gl.constexpr,
    STAGES: gl.constexpr,
    PINGPONG: gl.constexpr,  # two compute roles taking turns (16-bit only; num_warps 4)
    LOADER_WARPS: gl.constexpr,
    LOADER_REGISTERS: gl.constexpr,
    num_warps: gl.constexpr,
):
    BM: gl.constexpr = act_desc.block_type.shape[0]
    BK: gl.constexpr = act_desc.block_type.shape[1]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    dtype: gl.constexpr = act_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BM, BK], act_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES, BN, BK], w_desc.layout)
    ready, empty = stage_barriers(STAGES)
    p = _W2Args(
        act_desc, w_desc, a_bufs, b_bufs, ready, empty, block_experts_ptr, num_blocks, H, inter
    )
    e = _Epilogue(bias_ptr, out_ptr, pair_ids_ptr, topk_weights_ptr, top_k, stride_bias, stride_out)
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
                    (p, e, lora, scales, order, False, HAS_BIAS, HAS_LORA, ATOMIC_SUM, BM, BN,
                     BK, STAGES, RP, num_warps, 0, 2),
                ),
                (
                    _compute,
                    (p, e, lora, scales, order, False, HAS_BIAS, HAS_LORA, ATOMIC_SUM, BM, BN,
                     BK, STAGES, RP, num_warps, 1, 2),
                ),
                (_loader, (p, BM, BN, BK, STAGES)),
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
                    (p, e, lora, scales, None, FP8, HAS_BIAS, HAS_LORA, ATOMIC_SUM, BM, BN, BK,
                     STAGES, RP, num_warps),
                ),
                (_loader, (p, BM, BN, BK, STAGES)),
            ],
            [LOADER_WARPS],
            [LOADER_REGISTERS],
        )  # fmt: skip
    invalidate_barriers(ready, empty, STAGES)


def w2_stage_hopper(
    act: torch.Tensor,
    w2: torch.Tensor,
    b2: torch.Tensor | None,
    topk_weights: torch.Tensor,
    alignment: Alignment,
    xa: torch.Tensor | None,
    lora_b: torch.Tensor | None,
    row_slots: torch.Tensor | None,
    atomic_sum: bool,
    out: torch.Tensor,
    w2_scale: torch.Tensor | None = None,
    pingpong: bool = False,
) -> None:
    """The w2 stage (see the module doc) into ``out``; ``xa`` (max_rows, RP) from the LoRA
    shrink and ``lora_b`` (S, E, H, R) B2, or both None without LoRA; ``w2_scale``: w2 is FP8
    with these block scales, and act is quantised for the FP8 tensor cores first;
    ``pingpong``: the compute warpgroups take turns (``kernels.hopper_gemm``; 16-bit weights,
    FP8 runs them together)."""
    act_scale = None
    if w2_scale is not None:
        act, act_scale = quantize_activations(act)
    launch = w2_launch(
        act, w2, b2, topk_weights, alignment, xa, lora_b, row_slots, atomic_sum, out,
        act_scale, w2_scale, pingpong,
    )  # fmt: skip
    launch(act.device)


def w2_launch(
    act: torch.Tensor,
    w2: torch.Tensor,
    b2: torch.Tensor | None,
    topk_weights: torch.Tensor,
    alignment: Alignment,
    xa: torch.Tensor | None,
    lora_b: torch.Tensor | None,
    row_slots: torch.Tensor | None,
    atomic_sum: bool,
    out: torch.Tensor,
    act_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    pingpong: bool = False,
) -> KernelLaunch:
    """The w2 kernel's launch (arguments as ``w2_stage_hopper``'s; with FP8, act already
    quantised, its scales ``act_scale``)."""
    e, h, inter = w2.shape
    fp8 = w2_scale is not None
    pingpong = pingpong and not fp8
    block_n, block_k = (FP8_BLOCK_N, FP8_BLOCK_K) if fp8 else (BLOCK_N, BLOCK_K)
    if pingpong:
        block_n = PINGPONG_BLOCK_N
    stages = FP8_BUFFERS if fp8 else PINGPONG_BUFFERS if pingpong else NUM_BUFFERS
    act_desc, w_desc = tma_operands(act, w2.view(e * h, inter), block_n, block_k)
    lora = LaunchLoRA.of(xa, lora_b, row_slots, out, alignment.sorted_pair_ids)
    bias = b2 if b2 is not None else out
    scale_args = fp8_scale_args(act_scale, w2_scale, topk_weights)
    return KernelLaunch(
        _w2_hopper_kernel,
        alignment.max_blocks * triton.cdiv(h, block_n),
        (
            act_desc, w_desc, lora.xa, lora.b, bias, out, alignment.sorted_pair_ids,
            lora.row_slots, alignment.block_experts, topk_weights,
            *scale_args[:2],
            alignment.max_blocks, h, inter, topk_weights.shape[1], lora.rank, *lora.strides,
            bias.stride(0), out.stride(0), *scale_args[2:],
        ),
        dict(
            FP8=fp8, HAS_BIAS=b2 is not None, HAS_LORA=lora.on, ATOMIC_SUM=atomic_sum,
            RP=lora.padded_rank, STAGES=stages, PINGPONG=pingpong, LOADER_WARPS=LOADER_WARPS,
            LOADER_REGISTERS=LOADER_REGISTERS,
            num_warps=PINGPONG_WARPS.value if pingpong else NUM_WARPS,
        ),
    )  # fmt: skip
