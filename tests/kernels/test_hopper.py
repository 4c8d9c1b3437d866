"""The warp-specialised Gluon GEMMs for Hopper (``kernels.hopper_w13``, ``kernels.hopper_w2``).

On any machine: they build for sm_90 into what they are meant to be (wgmma on the tensor
cores, TMA loads, roles with their own register budgets) within a multiprocessor's shared
memory; ``gather_rows`` (Triton, run by the interpreter here) lays rows out as its torch
reference does; and a configuration that asks for the Hopper kernels where they cannot run
(the interpreter) answers through the Triton kernels exactly as without it. On a Hopper GPU:
their answers against the float32 reference, with and without LoRA, biases, both activations,
the atomic sum, at real shapes and at sizes that are not multiples of their tiles.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

from kernels import hopper_gemm, hopper_w2, hopper_w13
from kernels.align import Alignment, align_pairs
from kernels.configs import MoEConfig
from kernels.forward import fused_moe, moe_forward
from kernels.heuristic import heuristic_config
from kernels.hopper_w13 import gather_rows, gather_rows_reference
from kernels.reference import moe_forward_reference
from kernels.routing import route
from kernels.synthetic import (
    fp8_layer,
    lora_context,
    random_hidden,
    random_layer,
    random_routing,
    random_slots,
    relative_error,
    worst_row_error,
)
from kernels.types import Activation, LoRAContext, MoELayerWeights, Routing
from tests.conftest import REPO
from tests.kernels.sm90_build import VARIANTS, Variant

from .conftest import assert_rows_close
from .test_fp8 import CASES as FP8_CASES
from .test_fp8 import W8A8_TOLERANCE
from .test_fp8 import _inputs as fp8_inputs
from .test_fused_moe import CASES, _inputs


@pytest.fixture(scope="module")
def sm90_builds() -> dict[str, dict[str, Any]]:
    """Every variant built for sm_90 (``tests.kernels.sm90_build``, in a process without the
    interpreter)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    built = subprocess.run(
        [sys.executable, "-m", "tests.kernels.sm90_build"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-3000:]
    result: dict[str, dict[str, Any]] = json.loads(built.stdout)
    return result


@pytest.mark.parametrize("variant", [v for v in VARIANTS if v.rp == 16], ids=lambda v: v.name)
def test_builds_for_hopper_as_a_warp_specialised_wgmma_kernel(
    sm90_builds: dict[str, dict[str, Any]], variant: Variant
) -> None:
    asm = sm90_builds[variant.name]
    sass = asm["sass"]
    # Warpgroups of 64-row wgmmas, fp32 accumulators, 16-deep steps (SASS names bf16 operands;
    # fp16 is its default); w2 one 256-column accumulator, w13 a gate and an up of 128; taking
    # turns, each warpgroup half as wide.
    operand = ".BF16" if variant.dtype == "bfloat16" else " "
    if variant.fp8:  # the FP8 tensor cores (32-deep steps); the LoRA expand stays 16-bit
        columns = hopper_w2.FP8_BLOCK_N if variant.kernel == "w2" else hopper_w13.FP8_BLOCK_I
        assert f"QGMMA.64x{columns}x32.F32.E4M3.E4M3" in sass
        assert (f"HGMMA.64x{columns}x16.F32{operand}" in sass) == variant.lora
    elif variant.pingpong:
        pingpong = hopper_w2.PINGPONG_BLOCK_N, hopper_w13.PINGPONG_BLOCK_I
        columns = pingpong[0] if variant.kernel == "w2" else pingpong[1]
        assert f"HGMMA.64x{columns}x16.F32{operand}" in sass
    else:
        columns = hopper_w2.BLOCK_N if variant.kernel == "w2" else hopper_w13.BLOCK_I
        assert f"HGMMA.64x{columns}x16.F32{operand}" in sass
    assert "UTMALDG.2D" in sass  # the copy engine loads the tiles
    # The loader warp gives its registers up; the compute warpgroups take them.
    assert "setmaxnreg.dec" in asm["ptx"] and "setmaxnreg.inc" in asm["ptx"]
    if variant.kernel == "w2":  # the atomic sum over k
        assert ("REDG.E.ADD.F32" in sass) == variant.switch
    # The registers suffice: no spills to local memory at rank 16, but for one register that
    # w2 taking turns keeps in local memory across its atomic-sum epilogue with LoRA (a store
    # and a load a tile).
    one_spill = variant.pingpong and variant.kernel == "w2" and variant.switch and variant.lora
    assert sass.count("STL") <= one_spill and sass.count("LDL") <= one_spill


def test_fit_in_shared_memory_up_to_their_largest_rank(
    sm90_builds: dict[str, dict[str, Any]],
) -> None:
    """Every variant's stages, LoRA tiles and layout conversions fit an sm_90 multiprocessor
    (227 KB a block): a launch would otherwise fail for want of it."""
    assert {v.rp for v in VARIANTS} == {16, hopper_gemm.MAX_RANK}
    for variant in VARIANTS:
        shared = sm90_builds[variant.name]["shared"]
        assert shared <= 232_448, f"{variant.name}: {shared} bytes"


@pytest.mark.parametrize("tokens", [1, 37, 300])
def test_gather_rows_matches_its_reference(tokens: int) -> None:
    routing = random_routing(tokens, 6, 2, seed=tokens)
    hidden = random_hidden(tokens, 72, dtype=torch.float16, seed=tokens)
    alignment = align_pairs(routing.topk_ids, 6, hopper_gemm.BLOCK_M, None)
    got = gather_rows(hidden, alignment, 2)
    expected = gather_rows_reference(hidden, alignment, 2)
    used = (alignment.block_experts >= 0).repeat_interleave(alignment.block_m)
    assert int(used.sum()) >= tokens * 2
    assert torch.equal(got[used], expected[used])


def test_take_16_bit_and_w8a8_fp8_operands_in_blocks_of_128_rows_and_nothing_else() -> None:
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    w = torch.zeros(2, 32, 64, dtype=torch.bfloat16)
    ids = torch.zeros(256, dtype=torch.int32)
    blocks = Alignment(ids, None, ids[:2], hopper_gemm.BLOCK_M)

    def takes(**change: Any) -> bool:
        args: dict[str, Any] = {
            "x": x, "w": w, "alignment": blocks, "w_scale": None, "lora_rank": 16,
            "sizes": (32, 64),
        }  # fmt: skip
        return hopper_gemm.hopper_takes(**(args | change))

    assert takes()
    assert takes(x=x.half(), w=w.half(), lora_rank=hopper_gemm.MAX_RANK)
    fp8 = {"w": w.to(torch.float8_e4m3fn), "w_scale": torch.ones(2, 1, 1), "sizes": (64, 64)}
    assert takes(**fp8, w8a8=True)  # FP8 weights, the input quantised too
    assert takes(**fp8, w8a8=True, x=x.half())
    assert not takes(**fp8)  # FP8 weights, 16-bit input: the Triton kernels' W8A16 loops
    assert not takes(**(fp8 | {"sizes": (64, 96)}), w8a8=True)  # a w13 tile: two scale blocks
    assert not takes(w=fp8["w"], w8a8=True)  # FP8 weights without their scales
    assert not takes(x=x.float(), w=w.float())
    assert not takes(x=x.half())  # dtypes differ
    assert not takes(alignment=dataclasses.replace(blocks, block_m=64))
    assert not takes(alignment=dataclasses.replace(blocks, pair_blocks=True))
    assert not takes(sizes=(36, 64))  # rows of 72 bytes: not 16-byte TMA rows
    assert not takes(w=w.transpose(1, 2))
    storage = torch.zeros(w.numel() + 8, dtype=w.dtype)
    assert not takes(w=storage[1 : 1 + w.numel()].view(w.shape))  # not 16-byte aligned
    assert not takes(lora_rank=2 * hopper_gemm.MAX_RANK)
    # Where they can run at all: never on the CPU.
    assert not hopper_gemm.on_hopper(x.device)


def _hopper(config: MoEConfig, pingpong: bool = False) -> MoEConfig:
    return dataclasses.replace(
        config.each_gemm(hopper=True, fused_shrink=False, pingpong=pingpong),
        block_m=hopper_gemm.BLOCK_M,
    )


@pytest.mark.parametrize("atomic_sum", [False, True])
@pytest.mark.parametrize("name", ["tokens_not_multiple_of_block_m_odd_shapes_fp16", "top_k_8_fp16"])
def test_asked_for_where_they_cannot_run_the_triton_kernels_answer(
    name: str, atomic_sum: bool
) -> None:
    """Off sm_90 (here, the interpreter) the knob changes nothing: bit for bit the answer of
    the same configuration without it."""
    case = CASES[name]
    hidden, layer, lora, routing = _inputs(case, seed=5)
    config = dataclasses.replace(
        case.config(atomic_sum=atomic_sum).each_gemm(fused_shrink=False),
        block_m=hopper_gemm.BLOCK_M,
    )
    for context in (lora, None):
        plain = fused_moe(hidden, layer, context, routing, config)
        for pingpong in (False, True):
            asked = fused_moe(hidden, layer, context, routing, _hopper(config, pingpong))
            assert torch.equal(plain, asked), (name, pingpong)


@pytest.mark.parametrize(
    "name", ["aligned_h256_i128_fused_shrink_sum_pass", "gpt_oss_biases_h192_i160"]
)
def test_asked_for_w8a8_where_they_cannot_run_the_triton_kernels_answer(name: str) -> None:
    """FP8 experts with quantised inputs: off sm_90 the knob changes nothing either (the
    Triton W8A8 loops, bit for bit)."""
    case = FP8_CASES[name]
    hidden, layer, lora = fp8_inputs(case, torch.float32)
    routing = route(hidden, layer)
    config = dataclasses.replace(case.config("w8a8"), block_m=hopper_gemm.BLOCK_M)
    for context in (lora, None):
        plain = fused_moe(hidden, layer, context, routing, config)
        asked = fused_moe(hidden, layer, context, routing, _hopper(config))
        assert torch.equal(plain, asked), name


gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs a Hopper GPU (sm_90)",
)


@gpu
@pytest.mark.gpu
@pytest.mark.usefixtures("poison_allocations")
@pytest.mark.parametrize("pingpong", [False, True])
@pytest.mark.parametrize("atomic_sum", [False, True])
@pytest.mark.parametrize(
    ("shape", "tokens", "dtype", "activation"),
    [
        ((128, 2048, 768, 8), 4096, torch.bfloat16, Activation.SILU),  # Qwen3-30B-A3B
        ((128, 2048, 768, 8), 300, torch.bfloat16, Activation.SILU),  # few rows, padding blocks
        # GPT-OSS-20B, biases: H and I not multiples of the tiles' columns.
        ((32, 2880, 2880, 4), 1024, torch.bfloat16, Activation.GPT_OSS),
        ((8, 1000, 680, 2), 777, torch.float16, Activation.SILU),
    ],
)
def test_matches_the_reference_on_hopper(
    shape: tuple[int, int, int, int],
    tokens: int,
    dtype: torch.dtype,
    activation: Activation,
    atomic_sum: bool,
    pingpong: bool,
) -> None:
    e, h, i, k = shape
    gpt_oss = activation is Activation.GPT_OSS
    layer = random_layer(
        e, h, i, k, dtype=dtype, device="cuda", activation=activation, biases=gpt_oss
    )
    hidden = random_hidden(tokens, h, dtype=dtype, device="cuda")
    routing = random_routing(tokens, e, k, device="cuda")
    slots = random_slots(layer, 8, 16, enabled=[True] * 7 + [False])
    # Adapters round-robin over slots 0..4, every 6th token without one, slot 7 disabled:
    # blocks hold several segments.
    token_slots = torch.tensor([(t % 6) - 1 if t % 6 else 7 for t in range(tokens)])
    lora = lora_context(slots, token_slots.to(torch.int32))
    # The large-M heuristic's tiles (blocks of 128 rows) at every M.
    config = _hopper(
        dataclasses.replace(heuristic_config(4096, e, h, i, k), atomic_sum=atomic_sum), pingpong
    )
    for context in (lora, None):
        expected = moe_forward_reference(hidden, layer, context, routing)
        got = _on_the_hopper_kernels(hidden, layer, context, routing, config)
        assert_rows_close(got, expected, f"{shape} M={tokens} lora={context is not None}")
        if pingpong and not atomic_sum:  # taking turns changes no sum's order: the same bits
            together = config.each_gemm(pingpong=False)
            assert torch.equal(got, fused_moe(hidden, layer, context, routing, together))


def _on_the_hopper_kernels(
    hidden: torch.Tensor,
    layer: MoELayerWeights,
    lora: LoRAContext | None,
    routing: Routing,
    config: MoEConfig,
) -> torch.Tensor:
    """``fused_moe``'s answer, checked to have launched both Hopper kernels."""
    return _launching_both_hopper_kernels(lambda: fused_moe(hidden, layer, lora, routing, config))


def _launching_both_hopper_kernels(run: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``run()``'s answer, checked to have launched both Hopper kernels."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        got = run()
        torch.cuda.synchronize()
    launched = {event.key for event in profile.key_averages()}
    for kernel in ("_w13_hopper_kernel", "_w2_hopper_kernel"):
        assert any(kernel in name for name in launched), sorted(launched)
    return got


@gpu
@pytest.mark.gpu
@pytest.mark.usefixtures("poison_allocations")
@pytest.mark.parametrize("atomic_sum", [False, True])
@pytest.mark.parametrize(
    ("shape", "tokens", "activation"),
    [
        ((128, 2048, 768, 8), 4096, Activation.SILU),  # Qwen3-30B-A3B
        # GPT-OSS-20B, biases: H and I not multiples of 128 (a K step past the end).
        ((32, 2880, 2880, 4), 1024, Activation.GPT_OSS),
        ((8, 1024, 640, 2), 300, Activation.SILU),  # few rows, padding blocks
    ],
)
def test_w8a8_matches_the_reference_on_hopper(
    shape: tuple[int, int, int, int], tokens: int, activation: Activation, atomic_sum: bool
) -> None:
    """FP8 experts (128×128 block scales) with both GEMMs' inputs quantised, on the FP8
    tensor cores, against the reference that quantises the same inputs (W8A8_TOLERANCE, the
    Triton W8A8 path's bounds); the LoRA (bf16) as in the 16-bit kernels."""
    e, h, i, k = shape
    gpt_oss = activation is Activation.GPT_OSS
    layer = fp8_layer(
        random_layer(e, h, i, k, device="cuda", activation=activation, biases=gpt_oss)
    )
    hidden = random_hidden(tokens, h, device="cuda")
    routing = random_routing(tokens, e, k, device="cuda")
    slots = random_slots(layer, 8, 16, enabled=[True] * 7 + [False])
    token_slots = torch.tensor([(t % 6) - 1 if t % 6 else 7 for t in range(tokens)])
    lora = lora_context(slots, token_slots.to(torch.int32))
    config = _hopper(dataclasses.replace(heuristic_config(4096, e, h, i, k), atomic_sum=atomic_sum))
    config = config.each_gemm(fp8_activations=True)
    bound, row_bound = W8A8_TOLERANCE[torch.bfloat16]
    for context in (lora, None):
        expected = moe_forward_reference(hidden, layer, context, routing, fp8_activations=True)
        got = _on_the_hopper_kernels(hidden, layer, context, routing, config)
        whole, worst = relative_error(got, expected), worst_row_error(got, expected)
        what = f"{shape} M={tokens} lora={context is not None}"
        assert whole < bound and worst < row_bound, f"{what}: {whole:.2e}, worst row {worst:.2e}"


@gpu
@pytest.mark.gpu
@pytest.mark.usefixtures("poison_allocations")
def test_a_layer_with_fp8_activations_takes_the_hopper_kernels_at_large_batches() -> None:
    """``moe_forward`` on FP8 experts with ``fp8_activations``: from tensor-core tiles up on
    the Hopper kernels' FP8 main loops (``quantised_inputs``), answers as the quantising
    reference."""
    e, h, i, k = 8, 1024, 640, 2
    layer = dataclasses.replace(
        fp8_layer(random_layer(e, h, i, k, device="cuda")), fp8_activations=True
    )
    hidden = random_hidden(2048, h, device="cuda")
    routing = random_routing(2048, e, k, device="cuda")
    got = _launching_both_hopper_kernels(lambda: moe_forward(hidden, layer, None, routing))
    expected = moe_forward_reference(hidden, layer, None, routing)
    bound, row_bound = W8A8_TOLERANCE[torch.bfloat16]
    whole, worst = relative_error(got, expected), worst_row_error(got, expected)
    assert whole < bound and worst < row_bound, f"{whole:.2e}, worst row {worst:.2e}"
