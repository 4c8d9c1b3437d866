"""kernels.hopper_w2, the warp-specialised Gluon w2 for Hopper.

On any machine: it builds for sm_90 into what it is meant to be (wgmma on the tensor cores, TMA
loads, roles with their own register budgets), and a configuration that asks for it where it
cannot run (the interpreter, here) answers through the Triton kernel exactly as without it. On a
Hopper GPU: its answers against the float32 reference, with and without LoRA, biases, the atomic
sum, at real shapes and at sizes that are not multiples of its tiles.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from typing import Any

import pytest
import torch

from kernels import hopper_w2
from kernels.configs import MoEConfig
from kernels.forward import fused_moe
from kernels.heuristic import heuristic_config
from kernels.reference import moe_forward_reference
from kernels.synthetic import (
    lora_context,
    random_hidden,
    random_layer,
    random_routing,
    random_slots,
)
from tests.conftest import REPO
from tests.kernels.sm90_build import variant

from .conftest import assert_rows_close
from .test_fused_moe import CASES, _inputs


@pytest.fixture(scope="module")
def sm90_builds() -> dict[str, dict[str, Any]]:
    """Every variant built for sm_90 (``tests.kernels.sm90_build``, in a process without the
    interpreter)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    built = subprocess.run(
        [sys.executable, "-m", "tests.kernels.sm90_build"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-3000:]
    result: dict[str, dict[str, Any]] = json.loads(built.stdout)
    return result


@pytest.mark.parametrize("atomic_sum", [False, True])
@pytest.mark.parametrize("has_lora", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_builds_for_hopper_as_a_warp_specialised_wgmma_kernel(
    sm90_builds: dict[str, dict[str, Any]], dtype: torch.dtype, has_lora: bool, atomic_sum: bool
) -> None:
    asm = sm90_builds[variant(str(dtype).removeprefix("torch."), has_lora, atomic_sum, 16)]
    sass = asm["sass"]
    # Two warpgroups of 64 rows, 256 columns, fp32 accumulators, 16-deep steps (SASS names
    # bf16 operands, fp16 is its default).
    operand = ".BF16" if dtype == torch.bfloat16 else " "
    assert f"HGMMA.64x{hopper_w2.BLOCK_N}x16.F32{operand}" in sass
    assert "UTMALDG.2D" in sass  # the copy engine loads the tiles
    # The loader warp gives its registers up; the compute warpgroups take them.
    assert "setmaxnreg.dec" in asm["ptx"] and "setmaxnreg.inc" in asm["ptx"]
    assert ("REDG.E.ADD.F32" in sass) == atomic_sum


def test_fits_in_shared_memory_up_to_its_largest_rank(
    sm90_builds: dict[str, dict[str, Any]],
) -> None:
    """Every variant's stages, LoRA tiles and layout conversions fit an sm_90 multiprocessor
    (227 KB a block): a launch would otherwise fail for want of it."""
    for name, asm in sm90_builds.items():
        assert asm["shared"] <= 232_448, f"{name}: {asm['shared']} bytes"
    assert variant("bfloat16", True, False, hopper_w2.MAX_RANK) in sm90_builds


def _hopper(config: MoEConfig) -> MoEConfig:
    return dataclasses.replace(
        config,
        block_m=hopper_w2.BLOCK_M,
        w2=dataclasses.replace(config.w2, hopper=True),
    )


@pytest.mark.parametrize("atomic_sum", [False, True])
@pytest.mark.parametrize("name", ["tokens_not_multiple_of_block_m_odd_shapes_fp16", "top_k_8_fp16"])
def test_asked_for_where_it_cannot_run_the_triton_kernel_answers(
    name: str, atomic_sum: bool
) -> None:
    """Off sm_90 (here, the interpreter) the knob changes nothing: bit for bit the answer of
    the same configuration without it."""
    case = CASES[name]
    hidden, layer, lora, routing = _inputs(case, seed=5)
    config = dataclasses.replace(case.config(atomic_sum=atomic_sum), block_m=hopper_w2.BLOCK_M)
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
@pytest.mark.parametrize("atomic_sum", [False, True])
@pytest.mark.parametrize(
    ("shape", "tokens", "dtype"),
    [
        ((128, 2048, 768, 8), 4096, torch.bfloat16),  # Qwen3-30B-A3B
        ((128, 2048, 768, 8), 300, torch.bfloat16),  # blocks with few rows, padding blocks
        ((32, 2880, 2880, 4), 1024, torch.bfloat16),  # GPT-OSS-20B: H not a multiple of 256
        ((8, 1000, 680, 2), 777, torch.float16),  # neither H nor I a multiple of the tiles
    ],
)
def test_matches_the_reference_on_hopper(
    shape: tuple[int, int, int, int], tokens: int, dtype: torch.dtype, atomic_sum: bool
) -> None:
    e, h, i, k = shape
    biases = h == 2880
    layer = random_layer(e, h, i, k, dtype=dtype, device="cuda", biases=biases)
    hidden = random_hidden(tokens, h, dtype=dtype, device="cuda")
    routing = random_routing(tokens, e, k, device="cuda")
    slots = random_slots(layer, 8, 16, enabled=[True] * 7 + [False])
    # Adapters round-robin over slots 0..4, every 6th token without one, slot 7 disabled:
    # blocks hold several segments.
    token_slots = torch.tensor([(t % 6) - 1 if t % 6 else 7 for t in range(tokens)])
    lora = lora_context(slots, token_slots.to(torch.int32))
    # The large-M heuristic's tiles (blocks of 128 rows) at every M.
    large = heuristic_config(4096, e, h, i, k)
    config = _hopper(dataclasses.replace(large, atomic_sum=atomic_sum))
    for context in (lora, None):
        expected = moe_forward_reference(hidden, layer, context, routing)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
            got = fused_moe(hidden, layer, context, routing, config)
            torch.cuda.synchronize()
        launched = {event.key for event in profile.key_averages()}
        assert any("_w2_hopper_kernel" in name for name in launched), sorted(launched)
        assert_rows_close(got, expected, f"{shape} M={tokens} lora={context is not None}")
