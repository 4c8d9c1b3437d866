"""What the Hopper (sm_90) Gluon GEMMs of ``kernels.hopper_w13`` and ``kernels.hopper_w2`` share.

Both are warp-specialised and persistent: each program (one per multiprocessor) walks its
(block, N tile) work items in the order of ``tile_of``, in two roles (``gl.warp_specialize``):

* a **loader** warp streams every K step of every item into ``NUM_BUFFERS`` shared-memory
  stages with the copy engine (TMA), each stage's arrival signalled on its ``ready`` barrier;
  it waits on the stage's ``empty`` barrier before reusing it, so it runs ahead into the next
  item while the epilogue of this one runs;
* the **compute** warpgroups (``NUM_WARPS``: two of 64 rows each) issue asynchronous wgmmas
  per stage, keep one stage's in flight, and release each stage once the wgmmas that read it
  have finished; then the epilogue, the LoRA expand included (``lora_expand``).

With ``GemmConfig.pingpong`` (16-bit operands) the two compute warpgroups take turns instead
(CUTLASS's ping-pong schedule): each owns every other work item of the program, a tile half as
wide (one warpgroup's wgmmas), and their main loops run one after the other on the one stage
ring (``turn_barriers``, ``wait_for_turn``), so that each one's epilogue (the LoRA expand
above all) runs beside the other's main loop, where the cooperative kernel runs them in
series. It pays where the epilogue is long beside a short K loop (w2 alone with LoRA, H200:
0.83–0.89 of the cooperative kernel's time on Qwen3-30B-A3B, 1.12 on Mixtral-8x7B at M =
4096): a configuration asks for it per GEMM, and the tuner tries it per GEMM
(``kernels.autotune.hopper_knobs``).

FP8 experts with quantised inputs (W8A8, ``FP8Scales``): the stages hold e4m3 tiles 128 deep,
one scale block of both operands; each step's wgmmas write a fresh product on the FP8 tensor
cores, which the compute warpgroups wait for and add to the sum scaled by the rows' input
scales and the weight block's scale (``fp8_step_scale``), as DeepSeek-V3's block-scaled GEMMs
do.

Why: at M = 4096 the Triton GEMMs (``kernels.fused_moe``) run at about half the tensor cores'
rate. Each Triton program loads, multiplies and then runs its epilogue with the tensor cores
idle, and 128×256 tiles use all 255 registers, so nothing else hides it; Triton 3.6 does not
warp-specialise these loops on sm_90.

Launch configuration in one place: blocks of 128 aligned rows, 64-wide K steps, three stages
(FP8: 128-wide, four; taking turns: four), two compute warpgroups, one loader warp with the
fewest registers (setmaxnreg gives the rest to the compute warpgroups); each kernel's tile
widths in its own module.
"""

# mypy: disable-error-code="no-untyped-def,untyped-decorator"
# (Gluon kernels take untyped descriptor and constexpr arguments.) No `from __future__ import
# annotations`: Gluon's aggregates read their field annotations as types.
import functools
from dataclasses import dataclass, field
from typing import Any, TypeAlias

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.language.core import _aggregate as aggregate

from kernels.align import Alignment
from kernels.types import FP8_BLOCK, FP8_DTYPE

BLOCK_M = 128
BLOCK_K = 64
NUM_BUFFERS = 3
NUM_WARPS = 8
LOADER_WARPS = 1
LOADER_REGISTERS = 40
#: The largest padded LoRA rank the epilogues take (their x·Aᵀ and B tiles share the shared
#: memory with the stages); larger ranks take the Triton kernels.
MAX_RANK = 64
#: Blocks per launch group (see ``tile_of``).
GROUP_M = gl.constexpr(8)
#: Ping-pong (``GemmConfig.pingpong``): warps of each compute role (one warpgroup), the
#: registers of the second role (the first takes what is left, 256), and stages: the tiles are
#: half as wide, so four fit where the cooperative kernel has three (five would not beside
#: rank 64's LoRA tiles and both roles' epilogues).
PINGPONG_WARPS = gl.constexpr(4)
PINGPONG_REGISTERS = gl.constexpr(240)
PINGPONG_BUFFERS = 4

GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
#: Every operand dtype the kernels take: 16-bit, or FP8 (e4m3) inputs and weights (W8A8).
OPERAND_DTYPES = {**GL_DTYPES, FP8_DTYPE: gl.float8e4nv}
#: W8A8: a K step is one 128-column scale block of both operands (their scales multiply each
#: step's product), in more stages (a step's wgmmas are waited for before the next: the
#: loader runs further ahead).
FP8_BLOCK_K = FP8_BLOCK
FP8_BUFFERS = 4
_FP8_K = gl.constexpr(FP8_BLOCK)

#: An aggregate's integer field: a launch passes an int argument equal to 1 (a contiguous
#: stride, a rank or top-k of 1) as a constexpr, any other as a tensor (see ``scalar``).
Scalar: TypeAlias = gl.tensor | gl.constexpr


@gluon.constexpr_function
def scalar(value):
    """An int argument as an aggregate's ``Scalar`` field: its tensor, or the constexpr its
    specialised value was (a constructor receives that as a plain int)."""
    return value if isinstance(value, gl.tensor) else gl.constexpr(value)


def on_hopper(device: torch.device) -> bool:
    """Whether ``device`` is an sm_90 GPU (the kernels' wgmma and setmaxnreg are sm_90a)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


def hopper_takes(
    x: torch.Tensor,
    w: torch.Tensor,
    alignment: Alignment,
    w_scale: torch.Tensor | None,
    lora_rank: int,
    sizes: tuple[int, ...],
    w8a8: bool = False,
) -> bool:
    """Whether the Hopper kernels take these operands: bf16/fp16 weights of x's dtype, or FP8
    (e4m3) weights with their 128×128 block scales ``w_scale`` where the GEMM's input is
    quantised too (``w8a8``; ``sizes`` then multiples of 64, so that a w13 tile lies in one
    scale block); aligned blocks of BLOCK_M rows (no pair blocks), ``sizes`` (the GEMM's N and
    K) multiples of 8 and ``w`` 16-byte aligned (what the copy engine reads), a padded LoRA
    rank (0: none) up to MAX_RANK."""
    if w_scale is None:
        weights = w.dtype in GL_DTYPES and x.dtype == w.dtype
    else:
        weights = w8a8 and w.dtype == FP8_DTYPE and x.dtype in GL_DTYPES
        weights = weights and all(size % 64 == 0 for size in sizes)
    return (
        weights
        and not alignment.pair_blocks
        and alignment.block_m == BLOCK_M
        and all(size % 8 == 0 for size in sizes)
        and x.stride(1) == 1
        and w.is_contiguous()
        and w.data_ptr() % 16 == 0  # a TMA descriptor's base
        and lora_rank <= MAX_RANK
    )


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def persistent_grid(device: torch.device, work_items: int) -> tuple[int]:
    """One program per multiprocessor, or per work item where there are fewer."""
    return (max(1, min(work_items, _multiprocessors(device.index or 0))),)


def tma_operands(
    x: torch.Tensor, w_rows: torch.Tensor, block_n: int, block_k: int
) -> tuple[TensorDescriptor, TensorDescriptor]:
    """The copy engine's descriptors of a GEMM's aligned input rows ``x`` (max_rows, K), in
    boxes of BLOCK_M rows, and of its weights seen as rows ``w_rows`` (E·N, K), in boxes of
    ``block_n``; both ``block_k`` deep, in their operand dtype's shared layout."""
    dtype = OPERAND_DTYPES[w_rows.dtype]
    x_layout = gl.NVMMASharedLayout.get_default_for([BLOCK_M, block_k], dtype)
    w_layout = gl.NVMMASharedLayout.get_default_for([block_n, block_k], dtype)
    return (
        TensorDescriptor.from_tensor(x, [BLOCK_M, block_k], x_layout),
        TensorDescriptor.from_tensor(w_rows, [block_n, block_k], w_layout),
    )


@dataclass(frozen=True)
class LaunchLoRA:
    """A launch's ``LoRAExpand`` arguments: each aligned row's xa, B and the row slots, or
    without LoRA (``on`` False) placeholders the kernel never reads."""

    on: bool
    xa: torch.Tensor
    b: torch.Tensor
    row_slots: torch.Tensor

    @staticmethod
    def of(
        xa: torch.Tensor | None,
        lora_b: torch.Tensor | None,
        row_slots: torch.Tensor | None,
        out: torch.Tensor,
        rows: torch.Tensor,
    ) -> "LaunchLoRA":
        """From the stage's LoRA operands (all three or none); ``out`` and ``rows`` (an
        int32 tensor of the aligned rows) stand in for them without LoRA."""
        on = xa is not None
        assert on == (lora_b is not None) == (row_slots is not None)
        return LaunchLoRA(
            on,
            xa if xa is not None else out,
            lora_b if lora_b is not None else out.view(1, 1, *out.shape),
            row_slots if row_slots is not None else rows,
        )

    @property
    def rank(self) -> int:
        return self.b.shape[3] if self.on else 1

    @property
    def padded_rank(self) -> int:
        return self.xa.shape[1] if self.on else 16

    @property
    def strides(self) -> tuple[int, ...]:
        """xa's row stride and B's four."""
        return (self.xa.stride(0), *self.b.stride())


@dataclass(frozen=True)
class KernelLaunch:
    """A persistent kernel's launch as its stage builds it: the kernel, its work items (the
    grid is one program per multiprocessor, or per item where there are fewer) and its
    arguments. Apart from the launch itself so that a test compiles exactly these arguments
    for sm_90 without a GPU (``tests/kernels/sm90_build.py``)."""

    kernel: Any
    work_items: int
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __call__(self, device: torch.device) -> None:
        self.kernel[persistent_grid(device, self.work_items)](*self.args, **self.kwargs)


@gluon.jit
def stage_barriers(STAGES: gl.constexpr):
    """Each stage's ``ready`` (its tiles arrived) and ``empty`` (its wgmmas are done)
    mbarriers, initialised and visible to the copy engine."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    fence_async_shared()
    return ready, empty


@gluon.jit
def turn_barriers():
    """The ping-pong roles' ``order`` mbarriers: role r's turn comes when the other role
    arrives on barrier r after its main loop."""
    order = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(order.index(i), count=1)
    fence_async_shared()
    return order


@gluon.jit
def wait_for_turn(order, ROLE: gl.constexpr, turn):
    """Waits until role ``ROLE`` may start its ``turn``-th main loop (counted from 0): role 0
    at once the first time (a fresh barrier's previous phase counts as complete), then each
    time after role 1's; role 1 after each of role 0's. The turns alternate strictly, so no
    role's stage waits run a lap of the ring ahead of the loader."""
    mbarrier.wait(order.index(ROLE), (turn & 1) ^ (1 - ROLE))


@gluon.jit
def invalidate_turn_barriers(order):
    for i in gl.static_range(2):
        mbarrier.invalidate(order.index(i))


@gluon.jit
def invalidate_barriers(ready, empty, STAGES: gl.constexpr):
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))


@gluon.jit
def tile_of(item, num_blocks, num_n, GROUP: gl.constexpr):
    """(block, N tile) of work item ``item``, in groups of GROUP blocks (all their N tiles,
    block fastest): a group's input rows and an expert's weight rows stay in L2. The order of
    ``kernels.fused_moe._program_tile``, which a Gluon kernel cannot call."""
    per_group = GROUP * num_n
    first = (item // per_group) * GROUP
    size = gl.minimum(num_blocks - first, GROUP)
    local = item % per_group
    return first + local % size, local // size


@aggregate
class LoRAExpand:
    """The LoRA operands an epilogue reads: each aligned row's x·Aᵀ (max_rows, RP) from the
    shrink launch, in the operand dtype or float32, its slot (-1: none), and B (S, E, N, R)."""

    xa_ptr: gl.tensor
    b_ptr: gl.tensor
    row_slots_ptr: gl.tensor
    R: Scalar
    stride_xa: Scalar
    stride_bs: Scalar
    stride_be: Scalar
    stride_bn: Scalar
    stride_br: Scalar

    @gluon.constexpr_function
    def __init__(
        self, xa_ptr, b_ptr, row_slots_ptr, R, stride_xa, stride_bs, stride_be, stride_bn,
        stride_br,
    ):  # fmt: skip
        self.xa_ptr = xa_ptr
        self.b_ptr = b_ptr
        self.row_slots_ptr = row_slots_ptr
        self.R = scalar(R)
        self.stride_xa = scalar(stride_xa)
        self.stride_bs = scalar(stride_bs)
        self.stride_be = scalar(stride_be)
        self.stride_bn = scalar(stride_bn)
        self.stride_br = scalar(stride_br)


@aggregate
class FP8Scales:
    """A W8A8 GEMM's scales, float32, contiguous in K blocks: its input's per aligned row and
    128 columns (max_rows, ceil(K/128)) and W's per 128×128 block (E, ceil(N/128),
    ceil(K/128)). Unread without FP8."""

    x_ptr: gl.tensor
    w_ptr: gl.tensor
    stride_x: Scalar
    stride_we: Scalar
    stride_wn: Scalar

    @gluon.constexpr_function
    def __init__(self, x_ptr, w_ptr, stride_x, stride_we, stride_wn):
        self.x_ptr = x_ptr
        self.w_ptr = w_ptr
        self.stride_x = scalar(stride_x)
        self.stride_we = scalar(stride_we)
        self.stride_wn = scalar(stride_wn)


@gluon.jit
def fp8_step_scale(scales: FP8Scales, rows, expert, w_row, k):
    """(BM,) float32 in ``rows``' layout: each row's input scale times the scale of W's
    block holding row ``w_row``, both at the K block of column ``k``."""
    k_block = k // _FP8_K
    x_scale = gl.load(scales.x_ptr + rows.to(gl.int64) * scales.stride_x + k_block)
    w_block = scales.w_ptr + expert * scales.stride_we + (w_row // _FP8_K) * scales.stride_wn
    return x_scale * gl.load(w_block + k_block)


def fp8_scale_args(
    x_scale: torch.Tensor | None, w_scale: torch.Tensor | None, like: torch.Tensor
) -> tuple[Any, ...]:
    """A launch's FP8Scales arguments, placeholders (``like``, never read) without FP8."""
    if x_scale is None or w_scale is None:
        return like, like, 0, 0, 0
    assert x_scale.stride(1) == 1 and w_scale.stride(2) == 1
    return x_scale, w_scale, x_scale.stride(0), w_scale.stride(0), w_scale.stride(1)


#: "No slot": above every slot index, the end of a block's walk over its segments.
_NO_SLOT = gl.constexpr(2**30)


@gluon.constexpr_function
def _expand_layout(RP, num_warps):
    """The layout of the expand's (rows, RP) operands: each thread loads 16-byte pieces."""
    return gl.BlockedLayout([1, 8], [32 * 8 // RP, RP // 8], [num_warps, 1], [1, 0])


@gluon.constexpr_function
def _expand_mma(BN, num_warps):
    """The accumulator's layout for the expand's 16-bit wgmmas: the main loop's own, but for
    the K of its instruction (32 with FP8 operands); the same registers either way."""
    return gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BN, 16]
    )


@gluon.jit
def _first_segment(
    lora: LoRAExpand, rows, dtype: gl.constexpr, RP: gl.constexpr, num_warps: gl.constexpr
):
    """The block's rows' slots, their xa (BM, RP) rounded to the operand dtype (as
    ``kernels.fused_moe._lora_expand`` rounds it) and the lowest slot (``_NO_SLOT``: none)."""
    layout: gl.constexpr = _expand_layout(RP, num_warps)
    lrows = gl.convert_layout(rows, gl.SliceLayout(1, layout))
    r = gl.arange(0, RP, layout=gl.SliceLayout(0, layout))
    slot = gl.load(lora.row_slots_ptr + lrows)
    xa = gl.load(lora.xa_ptr + lrows[:, None].to(gl.int64) * lora.stride_xa + r[None, :]).to(dtype)
    return slot, xa, gl.min(gl.where(slot >= 0, slot, _NO_SLOT), axis=0)


@gluon.jit
def _b_rows(b_rows, b_ok, RP: gl.constexpr, num_warps: gl.constexpr):
    """The tile's B rows (int64) and their flags in the expand's layout, once per tile."""
    rows_l: gl.constexpr = gl.SliceLayout(1, _expand_layout(RP, num_warps))
    return gl.convert_layout(b_rows, rows_l).to(gl.int64), gl.convert_layout(b_ok, rows_l)


@gluon.jit
def _segment_b(
    lora: LoRAExpand, s, expert, b_rows, b_ok, RP: gl.constexpr, num_warps: gl.constexpr
):
    """Slot ``s``'s B[s, expert] rows ``b_rows`` (BN, RP; from ``_b_rows``), zero where not
    ``b_ok`` or past the rank."""
    r = gl.arange(0, RP, layout=gl.SliceLayout(0, _expand_layout(RP, num_warps)))
    return gl.load(
        lora.b_ptr + s.to(gl.int64) * lora.stride_bs + expert * lora.stride_be
        + b_rows[:, None] * lora.stride_bn + r[None, :] * lora.stride_br,
        mask=b_ok[:, None] & (r < lora.R)[None, :],
        other=0.0,
    )  # fmt: skip


@gluon.jit
def lora_expand(
    acc,
    lora: LoRAExpand,
    expert,
    rows,
    b_rows,
    b_ok,
    dtype: gl.constexpr,
    BM: gl.constexpr,
    BN: gl.constexpr,
    RP: gl.constexpr,
    num_warps: gl.constexpr,
):
    """acc (BM, BN) += each row's xa (BM, RP) times its slot's B[s, e] rows ``b_rows`` (the
    tile's output columns; ``b_ok`` marks the real ones): one wgmma per adapter segment of the
    block (slots in increasing order), the other rows' xa zeroed, as
    ``kernels.fused_moe._lora_expand`` does with ``tl.dot``."""
    x_smem = gl.allocate_shared_memory(
        dtype, [BM, RP], gl.NVMMASharedLayout.get_default_for([BM, RP], dtype)
    )
    b_smem = gl.allocate_shared_memory(
        dtype, [BN, RP], gl.NVMMASharedLayout.get_default_for([BN, RP], dtype)
    )
    slot, xa, s = _first_segment(lora, rows, dtype, RP, num_warps)
    b_rows, b_ok = _b_rows(b_rows, b_ok, RP, num_warps)
    layout: gl.constexpr = acc.type.layout
    acc = gl.convert_layout(acc, _expand_mma(BN, num_warps))
    while s < _NO_SLOT:
        b = _segment_b(lora, s, expert, b_rows, b_ok, RP, num_warps)
        x_smem.store(gl.where((slot == s)[:, None], xa, 0.0).to(dtype))
        b_smem.store(b.to(dtype))
        fence_async_shared()
        gl.thread_barrier()  # every warp's rows are in shared memory before the wgmma reads them
        acc = warpgroup_mma(x_smem, b_smem.permute((1, 0)), acc)
        gl.thread_barrier()  # and read before the next segment overwrites them
        s = gl.min(gl.where(slot > s, slot, _NO_SLOT), axis=0)
    return gl.convert_layout(acc, layout)


@gluon.jit
def lora_expand_pair(
    acc0,
    acc1,
    lora: LoRAExpand,
    expert,
    rows,
    b_rows0,
    b_rows1,
    b_ok,
    dtype: gl.constexpr,
    BM: gl.constexpr,
    BN: gl.constexpr,
    RP: gl.constexpr,
    num_warps: gl.constexpr,
):
    """``lora_expand`` of two accumulators of the same rows (w13's gate and up, B rows
    ``b_rows0`` and ``b_rows1``): each segment's xa tile is stored once for both and their
    two wgmmas run together."""
    x_smem = gl.allocate_shared_memory(
        dtype, [BM, RP], gl.NVMMASharedLayout.get_default_for([BM, RP], dtype)
    )
    b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, RP], dtype)
    b0_smem = gl.allocate_shared_memory(dtype, [BN, RP], b_layout)
    b1_smem = gl.allocate_shared_memory(dtype, [BN, RP], b_layout)
    slot, xa, s = _first_segment(lora, rows, dtype, RP, num_warps)
    b_rows0, b_ok0 = _b_rows(b_rows0, b_ok, RP, num_warps)
    b_rows1, b_ok1 = _b_rows(b_rows1, b_ok, RP, num_warps)
    layout: gl.constexpr = acc0.type.layout
    acc0 = gl.convert_layout(acc0, _expand_mma(BN, num_warps))
    acc1 = gl.convert_layout(acc1, _expand_mma(BN, num_warps))
    while s < _NO_SLOT:
        b0 = _segment_b(lora, s, expert, b_rows0, b_ok0, RP, num_warps)
        b1 = _segment_b(lora, s, expert, b_rows1, b_ok1, RP, num_warps)
        x_smem.store(gl.where((slot == s)[:, None], xa, 0.0).to(dtype))
        b0_smem.store(b0.to(dtype))
        b1_smem.store(b1.to(dtype))
        fence_async_shared()
        gl.thread_barrier()  # every warp's rows are in shared memory before the wgmmas read them
        acc0 = warpgroup_mma(x_smem, b0_smem.permute((1, 0)), acc0, is_async=True)
        acc1 = warpgroup_mma(x_smem, b1_smem.permute((1, 0)), acc1, is_async=True)
        acc0, acc1 = warpgroup_mma_wait(0, deps=(acc0, acc1))
        gl.thread_barrier()  # and read before the next segment overwrites them
        s = gl.min(gl.where(slot > s, slot, _NO_SLOT), axis=0)
    return gl.convert_layout(acc0, layout), gl.convert_layout(acc1, layout)
