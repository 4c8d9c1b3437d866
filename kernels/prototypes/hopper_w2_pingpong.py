"""Prototype: kernels.hopper_w2 with two consumer warpgroups taking turns (ping-pong): each
owns every other tile of the program (128 x 128), their main loops run one after the other
(an order barrier), each one's epilogue beside the other's main loop. bf16/fp16, no FP8."""
# mypy: disable-error-code="no-untyped-def,untyped-decorator"
import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait,
)

from kernels.align import Alignment
from kernels.hopper_gemm import (
    BLOCK_K, GROUP_M, LOADER_REGISTERS, LOADER_WARPS, KernelLaunch, LaunchLoRA, LoRAExpand,
    invalidate_barriers, lora_expand, stage_barriers, tile_of, tma_operands, FP8Scales,
)
from kernels.hopper_w2 import _Epilogue, _loader, _W2Args

BLOCK_N = 128
STAGES = 4
CONSUMER_REGISTERS = 232


@gluon.jit
def _consumer(p: _W2Args, e: _Epilogue, lora: LoRAExpand, order,
              HAS_BIAS: gl.constexpr, HAS_LORA: gl.constexpr, ATOMIC_SUM: gl.constexpr,
              BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
              RP: gl.constexpr, ROLE: gl.constexpr):
    num_warps: gl.constexpr = 4
    lora_dtype: gl.constexpr = lora.b_ptr.dtype.element_ty
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1],
        instr_shape=[16, BN, 256 // p.act_desc.dtype.primitive_bitwidth],
    )
    store_layout: gl.constexpr = gl.BlockedLayout(
        [1, 8], [32 * 8 // BN, BN // 8], [num_warps, 1], [1, 0]
    )
    mma_rows: gl.constexpr = gl.SliceLayout(1, mma)
    mma_cols: gl.constexpr = gl.SliceLayout(0, mma)
    num_n = gl.cdiv(p.H, BN)
    steps = gl.cdiv(p.inter, BK)
    count = 0
    owned = 0  # real tiles of this program so far (both roles'), in order
    turns = 0  # this role's main loops so far
    for tile in range(gl.program_id(0), p.num_blocks * num_n, gl.num_programs(0)):
        block, n_tile = tile_of(tile, p.num_blocks, num_n, GROUP_M)
        expert = gl.load(p.block_experts_ptr + block)
        if expert >= 0:
            if owned % 2 == ROLE:
                expert64 = expert.to(gl.int64)
                # Our turn on the tensor cores: the other role's main loop has ended (a
                # fresh barrier's previous phase counts as complete for role 0's first).
                mbarrier.wait(order.index(ROLE), (turns & 1) ^ (1 - ROLE))
                acc = gl.zeros([BM, BN], gl.float32, layout=mma)
                for k in range(0, p.inter, BK):
                    stage = count % STAGES
                    mbarrier.wait(p.ready.index(stage), (count // STAGES) & 1)
                    acc = warpgroup_mma(
                        p.a_bufs.index(stage), p.b_bufs.index(stage).permute((1, 0)), acc,
                        is_async=True,
                    )
                    acc = warpgroup_mma_wait(1, deps=(acc,))
                    mbarrier.arrive(p.empty.index((count + STAGES - 1) % STAGES), pred=k > 0)
                    count += 1
                acc = warpgroup_mma_wait(0, deps=(acc,))
                mbarrier.arrive(p.empty.index((count + STAGES - 1) % STAGES))
                mbarrier.arrive(order.index(1 - ROLE))  # the other role's turn
                turns += 1

                rows = block * BM + gl.arange(0, BM, layout=mma_rows)
                cols = n_tile * BN + gl.arange(0, BN, layout=mma_cols)
                if HAS_LORA:
                    acc = lora_expand(
                        acc, lora, expert64, rows, cols, cols < p.H, lora_dtype, BM, BN, RP,
                        num_warps,
                    )
                if HAS_BIAS:
                    bias = gl.load(
                        e.bias_ptr + expert64 * e.stride_bias + cols, mask=cols < p.H, other=0.0
                    )
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
                    gl.atomic_add(
                        e.out_ptr + out_rows[:, None] + scols[None, :], y, mask=mask,
                        sem="relaxed",
                    )
                else:
                    out_rows = spair.to(gl.int64) * e.stride_out
                    y = gl.convert_layout(acc.to(e.out_ptr.dtype.element_ty), store_layout)
                    gl.store(e.out_ptr + out_rows[:, None] + scols[None, :], y, mask=mask)
            else:
                count += steps  # the other role's stages
            owned += 1


@gluon.jit
def _consumer1(p, e, lora, order, HAS_BIAS: gl.constexpr, HAS_LORA: gl.constexpr,
               ATOMIC_SUM: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr,
               STAGES: gl.constexpr, RP: gl.constexpr):
    _consumer(p, e, lora, order, HAS_BIAS, HAS_LORA, ATOMIC_SUM, BM, BN, BK, STAGES, RP, 1)


@gluon.jit
def _w2_pingpong_kernel(
    act_desc, w_desc, xa_ptr, b_ptr, bias_ptr, out_ptr, pair_ids_ptr, row_slots_ptr,
    block_experts_ptr, topk_weights_ptr, num_blocks, H, inter, top_k, R, stride_xa, stride_bs,
    stride_be, stride_bn, stride_br, stride_bias, stride_out,
    HAS_BIAS: gl.constexpr, HAS_LORA: gl.constexpr, ATOMIC_SUM: gl.constexpr, RP: gl.constexpr,
    STAGES: gl.constexpr, CONSUMER_REGISTERS: gl.constexpr, LOADER_WARPS: gl.constexpr,
    LOADER_REGISTERS: gl.constexpr, num_warps: gl.constexpr,
):
    BM: gl.constexpr = act_desc.block_type.shape[0]
    BK: gl.constexpr = act_desc.block_type.shape[1]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    dtype: gl.constexpr = act_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BM, BK], act_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES, BN, BK], w_desc.layout)
    ready, empty = stage_barriers(STAGES)
    order = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(order.index(i), count=1)
    fence_async_shared()
    p = _W2Args(
        act_desc, w_desc, a_bufs, b_bufs, ready, empty, block_experts_ptr, num_blocks, H, inter
    )
    e = _Epilogue(bias_ptr, out_ptr, pair_ids_ptr, topk_weights_ptr, top_k, stride_bias, stride_out)
    lora = LoRAExpand(
        xa_ptr, b_ptr, row_slots_ptr, R, stride_xa, stride_bs, stride_be, stride_bn, stride_br
    )
    gl.warp_specialize(
        [
            (_consumer, (p, e, lora, order, HAS_BIAS, HAS_LORA, ATOMIC_SUM, BM, BN, BK, STAGES,
                         RP, 0)),
            (_consumer1, (p, e, lora, order, HAS_BIAS, HAS_LORA, ATOMIC_SUM, BM, BN, BK,
                          STAGES, RP)),
            (_loader, (p, BM, BN, BK, STAGES)),
        ],
        [4, LOADER_WARPS],
        [CONSUMER_REGISTERS, LOADER_REGISTERS],
    )
    invalidate_barriers(ready, empty, STAGES)
    for i in gl.static_range(2):
        mbarrier.invalidate(order.index(i))


def w2_pingpong_launch(act, w2, b2, topk_weights, alignment: Alignment, xa, lora_b, row_slots,
                       atomic_sum: bool, out, stages: int = STAGES,
                       registers: int = CONSUMER_REGISTERS) -> KernelLaunch:
    e, h, inter = w2.shape
    act_desc, w_desc = tma_operands(act, w2.view(e * h, inter), BLOCK_N, BLOCK_K)
    lora = LaunchLoRA.of(xa, lora_b, row_slots, out, alignment.sorted_pair_ids)
    bias = b2 if b2 is not None else out
    return KernelLaunch(
        _w2_pingpong_kernel,
        alignment.max_blocks * triton.cdiv(h, BLOCK_N),
        (
            act_desc, w_desc, lora.xa, lora.b, bias, out, alignment.sorted_pair_ids,
            lora.row_slots, alignment.block_experts, topk_weights,
            alignment.max_blocks, h, inter, topk_weights.shape[1], lora.rank, *lora.strides,
            bias.stride(0), out.stride(0),
        ),
        dict(
            HAS_BIAS=b2 is not None, HAS_LORA=lora.on, ATOMIC_SUM=atomic_sum,
            RP=lora.padded_rank, STAGES=stages, CONSUMER_REGISTERS=registers,
            LOADER_WARPS=LOADER_WARPS, LOADER_REGISTERS=LOADER_REGISTERS, num_warps=4,
        ),
    )
