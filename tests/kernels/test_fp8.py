"""FP8 experts (float8_e4m3fn, a float32 scale per 128×128 block): the Triton path (W8A16) and
the torch backend against the reference of the dequantised weights, their launch
configurations, the layer's validation, and ``kernels.fp8``'s quantisation.

On the CPU the Triton path runs in the interpreter with fp32 and fp16 activations (its bf16
dots are wrong, see test_fused_moe.py); the bf16 cases run on a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import pytest
import torch

from kernels.autotune import CellInputs, Timer, precompile_set
from kernels.config_select import ConfigSelector
from kernels.configs import GemmConfig, MoEConfig, fit_stages
from kernels.forward import fused_moe, layer_shape, moe_forward
from kernels.fp8 import dequantize, expand_scales, quantize
from kernels.fp8_activations import (
    dequantize_activations,
    quantize_activations,
    quantize_activations_reference,
)
from kernels.heuristic import FP8_STREAMING_W2, FP8_STREAMING_W13, heuristic_config
from kernels.model_shape import LayerShape
from kernels.reference import moe_forward_reference
from kernels.routing import route
from kernels.synthetic import (
    fp8_layer,
    lora_context,
    random_hidden,
    random_layer,
    random_slots,
    relative_error,
    worst_row_error,
)
from kernels.types import (
    FP8_BLOCK,
    FP8_DTYPE,
    Activation,
    LoRAContext,
    MoELayerWeights,
    RouterKind,
    RouterSpec,
    validate_layer,
)

from .conftest import DEVICE, assert_rows_close

# Tolerances: the Triton path is compared with the float64 reference of the dequantised
# weights using the usual bounds of conftest.TOLERANCE / ROW_TOLERANCE. Scaling the product
# (GemmConfig.fp8_dequant off), the kernel's FP8 → x-dtype conversion is exact (e4m3 fits
# bf16, fp16 and fp32) and it computes (x·q)·s per K step where the reference takes x·(q·s):
# one more fp32 rounding per step, far below the bounds (measured: fp32 2-4e-7 against 2e-5,
# fp16 3-5e-4 against 3e-3). Dequantising the tile, q·s is rounded to x's dtype as a layer
# stored in that dtype would be: the bounds are those of such a layer.

#: W8A8 against the reference that quantises the same inputs: (whole, worst row). An input
#: that lies within its dtype's rounding of an FP8 rounding tie may round either way in the
#: kernel and in the reference (the activation is accumulated in a different order before
#: it is quantised): one FP8 step, 2^-4 of that input, in one of a row's K inputs moves the
#: row by about 2^-4/√K (measured in the interpreter: fp32 1.3e-7 without such a tie, 1.6e-4
#: / 9e-4 per row with one; fp16 up to 2.7e-3 / 1.4e-2). Skipping the quantisation would err
#: by ≈ 4e-2 (test_w8a8_quantises_only_the_experts_inputs).
W8A8_TOLERANCE = {
    torch.float32: (5e-3, 3e-2),
    torch.float16: (5e-3, 3e-2),
    torch.bfloat16: (2e-2, 4e-2),
}

#: Activation dtypes of the Triton path: bf16 only on a GPU (the interpreter's bf16 dots
#: are wrong).
DTYPES = [
    pytest.param(torch.float32, id="float32"),
    pytest.param(torch.float16, id="float16"),
    pytest.param(
        torch.bfloat16,
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
        ],
        id="bfloat16",
    ),
]


@dataclass(frozen=True)
class Case:
    hidden: int
    inter: int
    tokens: int = 24
    experts: int = 6
    top_k: int = 2
    w13: tuple[int, int] = (16, 32)  # block_n, block_k
    w2: tuple[int, int] = (32, 32)
    block_m: int = 16
    fused_shrink: bool = False
    split_k: int = 1
    atomic_sum: bool = True
    decode: bool = False
    gpt_oss: bool = False

    def config(self, main_loop: str = "scale_product") -> MoEConfig:
        dequant, w8a8 = main_loop == "dequant_tile", main_loop == "w8a8"
        fused = self.fused_shrink and not w8a8  # FP8 activations take the separate shrink
        knobs = {"fused_shrink": fused, "fp8_dequant": dequant, "fp8_activations": w8a8}
        return MoEConfig(
            block_m=self.block_m,
            lora_segments=2,
            w13=GemmConfig(*self.w13, 1, 4, 2, **knobs),
            w2=GemmConfig(*self.w2, 1, 4, 2, split_k=self.split_k, **knobs),
            atomic_sum=self.atomic_sum,
            decode=self.decode,
        )


CASES = {
    # H, I not multiples of 128. 64-wide w13 tiles hold up rows I+64.. that straddle the
    # scale blocks (rows 256 = I + 96); w2's K split in two parts, the second from k = 128.
    "aligned_h192_i160_split_k": Case(192, 160, w13=(64, 32), w2=(32, 64), split_k=2),
    "aligned_h256_i128_fused_shrink_sum_pass": Case(
        256,
        128,
        tokens=40,
        experts=8,
        w13=(32, 128),
        w2=(64, 128),
        block_m=32,
        fused_shrink=True,
        atomic_sum=False,
    ),
    # 128-wide K steps over H = 192: the second step masked past H.
    "decode_h192_i160_fused_shrink": Case(
        192, 160, tokens=3, w13=(16, 128), w2=(64, 32), fused_shrink=True, decode=True
    ),
    "decode_h256_i128_split_k": Case(
        256, 128, tokens=2, experts=4, w13=(32, 64), w2=(32, 32), split_k=3, decode=True
    ),
    "gpt_oss_biases_h192_i160": Case(
        192, 160, tokens=16, top_k=4, w13=(32, 64), w2=(64, 64), gpt_oss=True
    ),
}


def _inputs(
    case: Case, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, MoELayerWeights, LoRAContext]:
    router = RouterSpec(
        RouterKind.TOPK_SOFTMAX if case.gpt_oss else RouterKind.SOFTMAX_TOPK, case.top_k, True
    )
    layer = random_layer(
        case.experts, case.hidden, case.inter, case.top_k, dtype=dtype, device=DEVICE,
        seed=seed, router=router, biases=case.gpt_oss,
        activation=Activation.GPT_OSS if case.gpt_oss else Activation.SILU,
    )  # fmt: skip
    layer = fp8_layer(layer)
    hidden = random_hidden(case.tokens, case.hidden, dtype=dtype, device=DEVICE, seed=seed + 1)
    if case.gpt_oss:
        hidden = hidden * 4.0  # into the clamps of the gpt_oss activation
    slots = random_slots(layer, 3, 8, seed=seed + 2)
    # Slots -1, 0, 1, 2 in turn: every token count here has one without an adapter.
    token_slots = (torch.arange(case.tokens) % 4 - 1).to(torch.int32)
    return hidden, layer, lora_context(slots, token_slots)


@pytest.mark.usefixtures("poison_allocations")
@pytest.mark.parametrize("main_loop", ["scale_product", "dequant_tile", "w8a8"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(CASES))
def test_triton_fp8_matches_dequantised_reference(
    name: str, dtype: torch.dtype, main_loop: str
) -> None:
    """Each main loop against the float64 reference of the dequantised weights; W8A8 against
    the reference that quantises the GEMMs' inputs as it does (that quantisation is its
    numerics, several times the bounds: see test_w8a8_quantises_only_the_experts_inputs)."""
    case = CASES[name]
    hidden, layer, lora = _inputs(case, dtype)
    assert layer.fp8 and layer.dtype == dtype
    routing = route(hidden, layer)
    got = fused_moe(hidden, layer, lora, routing, case.config(main_loop))
    assert got.dtype == dtype and got.shape == hidden.shape
    what = f"{name} {dtype} {main_loop}"
    if main_loop != "w8a8":
        expected = moe_forward_reference(hidden, layer, lora, routing, torch.float64)
        assert_rows_close(got, expected, what)
        return
    expected = moe_forward_reference(hidden, layer, lora, routing, torch.float64, True)
    whole, worst = relative_error(got, expected), worst_row_error(got, expected)
    bound, row_bound = W8A8_TOLERANCE[dtype]
    assert whole < bound and worst < row_bound, f"{what}: {whole:.2e}, worst row {worst:.2e}"


def test_w8a8_quantises_only_the_experts_inputs() -> None:
    """The W8A8 reference differs from the bf16-activation one by far more than the kernels'
    bounds (so the comparison above sees a kernel that skips the quantisation), and the LoRA
    reads unquantised inputs: with the experts' weights zero only biases and LoRA remain, and
    W8A8 gives the plain answer — the reference exactly, the kernel within the usual bounds
    (quantising the LoRA's inputs would move it by about 4e-2)."""
    case = CASES["gpt_oss_biases_h192_i160"]
    hidden, layer, lora = _inputs(case, torch.float32)
    routing = route(hidden, layer)
    plain = moe_forward_reference(hidden, layer, lora, routing, torch.float64)
    w8a8 = moe_forward_reference(hidden, layer, lora, routing, torch.float64, True)
    assert relative_error(w8a8, plain) > 2e-2
    zero = dataclasses.replace(
        layer, w13=torch.zeros_like(layer.w13), w2=torch.zeros_like(layer.w2)
    )
    expected = moe_forward_reference(hidden, zero, lora, routing, torch.float64)
    assert expected.abs().max() > 0
    w8a8_zero = moe_forward_reference(hidden, zero, lora, routing, torch.float64, True)
    assert torch.equal(w8a8_zero, expected)
    got = fused_moe(hidden, zero, lora, routing, case.config("w8a8"))
    assert_rows_close(got, expected, "zero experts, w8a8")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_activation_quantisation_kernel_equals_its_reference(dtype: torch.dtype) -> None:
    """Equal values (scales bit for bit), ties to even included, over rows of very different
    magnitudes, an all-zero group and a ragged last group."""
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(37, 300, generator=gen) * torch.logspace(-6, 3, 37)[:, None]
    rows[4, :128] = 0.0
    rows[5, :4] = torch.tensor([448.0, 168.0, -176.0, 7.9])  # a tie and a carry at e4m3
    x = rows.to(dtype).to(DEVICE)
    q, scale = quantize_activations(x)
    q_ref, scale_ref = quantize_activations_reference(x)
    assert scale.shape == (37, 3) and scale.dtype == torch.float32
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q.float(), q_ref.float())  # ±0 alike: a product does not tell them apart
    assert scale[4, 0] == 1.0
    back = dequantize_activations(q, scale, torch.float64)
    bound = 2**-4 * x.double().abs() + 2**-10 * scale.double().repeat_interleave(128, 1)[:, :300]
    assert ((back - x.double()).abs() <= bound).all()


@pytest.mark.usefixtures("poison_allocations")
def test_entry_point_with_selected_config() -> None:
    """moe_forward on an FP8 layer: routing, and the heuristic's configuration fitted to FP8."""
    hidden, layer, lora = _inputs(Case(192, 160, tokens=8), torch.float16, seed=5)
    got = moe_forward(hidden, layer, lora)
    expected = moe_forward_reference(hidden, layer, lora, compute_dtype=torch.float64)
    assert_rows_close(got, expected, "moe_forward")


@pytest.mark.usefixtures("poison_allocations")
@pytest.mark.parametrize("tokens", [8, 200])  # streaming tiles, tensor-core tiles
def test_a_layer_with_fp8_activations_quantises_its_inputs_on_both_backends(tokens: int) -> None:
    """``MoELayerWeights.fp8_activations``: moe_forward runs W8A8 (on the Triton loops here;
    a Hopper GPU takes its kernels from tensor-core tiles up) and the torch backend the
    reference that quantises; both differ from the layer without the flag by more than the
    bounds, so neither can skip it."""
    hidden, plain_layer, lora = _inputs(Case(192, 160, tokens=tokens), torch.float32, seed=9)
    layer = dataclasses.replace(plain_layer, fp8_activations=True)
    assert layer.weight_format == "fp8_e4m3_block128_w8a8"
    routing = route(hidden, layer)
    expected = moe_forward_reference(hidden, layer, lora, routing, torch.float64)
    plain = moe_forward_reference(hidden, plain_layer, lora, routing, torch.float64)
    assert relative_error(expected, plain) > 2e-2
    got = moe_forward(hidden, layer, lora, routing)
    whole, worst = relative_error(got, expected), worst_row_error(got, expected)
    bound, row_bound = W8A8_TOLERANCE[torch.float32]
    assert whole < bound and worst < row_bound, f"{whole:.2e}, worst row {worst:.2e}"
    torch_got = moe_forward(hidden, layer, lora, routing, backend="torch")
    assert torch.equal(torch_got, moe_forward_reference(hidden, layer, lora, routing))


@pytest.mark.usefixtures("poison_allocations")
def test_the_autotuner_runs_a_w8a8_layer_as_its_forward_does() -> None:
    """The autotuner's timer runs each candidate as ``moe_forward`` would for the layer (its
    W8A8 form) and checks it against the quantising reference: a tuned configuration is
    measured as it will run."""
    plain = fp8_layer(random_layer(4, 192, 160, 2, dtype=torch.float32, device=DEVICE))
    layer = dataclasses.replace(plain, fp8_activations=True)
    config = fit_stages(heuristic_config(16, 4, 192, 160, 2, 4, fp8=True), 4, 8, fp8=True)
    assert not config.w13.fp8_activations
    timer = Timer(layer, CellInputs.make(layer, 16, 8, 8))
    assert timer.error(config) < W8A8_TOLERANCE[torch.float32][0]
    inputs = timer.inputs
    w8a16 = fused_moe(inputs.hidden, plain, inputs.lora, inputs.routing, config)
    assert relative_error(timer.run(config), w8a16) > 2e-2


def test_fp8_activations_need_fp8_experts() -> None:
    layer = dataclasses.replace(random_layer(4, 64, 32, 2), fp8_activations=True)
    with pytest.raises(ValueError, match="fp8_activations"):
        validate_layer(layer)


def test_launcher_refuses_k_steps_across_scale_blocks() -> None:
    case = Case(192, 160, tokens=2, w13=(16, 256), decode=True)
    hidden, layer, lora = _inputs(case, torch.float32)
    with pytest.raises(AssertionError, match="BLOCK_K"):
        fused_moe(hidden, layer, lora, route(hidden, layer), case.config())


def _dequantised(layer: MoELayerWeights) -> MoELayerWeights:
    """The plain layer of an FP8 layer's dequantised weights, in its compute dtype."""
    assert layer.w13_scale is not None and layer.w2_scale is not None
    return dataclasses.replace(
        layer,
        w13=dequantize(layer.w13, layer.w13_scale, layer.dtype),
        w2=dequantize(layer.w2, layer.w2_scale, layer.dtype),
        w13_scale=None,
        w2_scale=None,
    )


def test_torch_backend_is_the_reference_of_the_dequantised_layer() -> None:
    original = random_layer(5, 192, 160, 2, dtype=torch.float32, biases=True, shared_inter=32)
    layer = fp8_layer(original)
    hidden = random_hidden(12, 192, dtype=torch.float32)
    slots = random_slots(layer, 3, 8)
    lora = lora_context(slots, (torch.arange(12) % 4 - 1).to(torch.int32))
    got = moe_forward(hidden, layer, lora, backend="torch")
    assert torch.equal(got, moe_forward_reference(hidden, _dequantised(layer), lora))
    # FP8 keeps 3 mantissa bits (≈2.5% RMS per weight), through two GEMMs: near the original.
    assert relative_error(got, moe_forward_reference(hidden, original, lora)) < 0.1


def test_fp8_configurations_take_pointer_loads_and_short_k_steps() -> None:
    """Every configuration an FP8 layer gets (heuristic, autotuning's compile set) loads its
    weights by pointers with BLOCK_K dividing 128; FP8 shapes are keyed apart from bf16; the
    heuristic dequantises every tile, streaming through the FP8 tiles past decode steps."""
    selector = ConfigSelector("test-gpu", use_tables=False)
    # DeepSeek-V3 (256-wide K steps at M = 1 in bf16) and Qwen3 (TMA in the compute regime).
    shapes = (LayerShape(256, 7168, 2048, 8, fp8=True), LayerShape(128, 2048, 768, 8, fp8=True))
    configs = []
    for shape in shapes:
        for tokens in (1, 8, 64, 4096):
            configs.append(selector.select(tokens, shape, 16, torch.bfloat16).config)
            configs += precompile_set(configs[-1], tokens * 8 / shape.experts, 16, fp8=True)
    gemms = [g for c in configs for g in (c.w13, c.w2)]
    assert not any(g.tma for g in gemms)
    assert all(FP8_BLOCK % g.block_k == 0 for g in gemms)
    # The heuristic's main loop: tiles dequantised in decode, from M = 8 (the FP8 streaming
    # tiles) and in the tensor-core regime; bf16 experts never dequantise.
    chosen = {t: selector.select(t, shapes[1], 16, torch.bfloat16).config for t in (1, 8, 4096)}
    assert chosen[1].decode and chosen[1].w13.fp8_dequant and chosen[1].w2.fp8_dequant
    assert chosen[8].w13.block_n == FP8_STREAMING_W13.block_n and chosen[8].w13.fp8_dequant
    assert chosen[8].w2.block_n == FP8_STREAMING_W2.block_n and chosen[8].w2.fp8_dequant
    assert chosen[4096].w13.fp8_dequant and chosen[4096].w2.fp8_dequant
    bf16_shape = dataclasses.replace(shapes[1], fp8=False)
    plain = selector.select(8, bf16_shape, 16, torch.bfloat16).config
    assert plain.w13.block_n != FP8_STREAMING_W13.block_n and not plain.w13.fp8_dequant
    bf16 = random_layer(4, 64, 32, 2, dtype=torch.bfloat16)
    assert layer_shape(fp8_layer(bf16)).key == layer_shape(bf16).key + ",weights=fp8"


def _invalid_fp8_layers() -> dict[str, tuple[str, MoELayerWeights]]:
    """Broken FP8 layers by case: (the error message expected, the layer)."""
    layer = fp8_layer(random_layer(4, 192, 160, 2, dtype=torch.float32))
    validate_layer(layer)
    assert layer.w13_scale is not None and layer.w2_scale is not None
    replace = functools.partial(dataclasses.replace, layer)
    return {
        "missing_w2_scale": ("w13_scale and w2_scale", replace(w2_scale=None)),
        # H=192, I=160: w13_scale is (4, ceil(320/128), ceil(192/128)) = (4, 3, 2).
        "scale_shape": (
            r"w13_scale must have shape \(4, 3, 2\)",
            replace(w13_scale=layer.w13_scale[:, :2]),
        ),
        "scale_dtype": (
            "w2_scale must be float32, got float64",
            replace(w2_scale=layer.w2_scale.double()),
        ),
        "fp8_without_scales": (
            "w13 must be bfloat16, float16, float32, got float8_e4m3fn",
            replace(w13_scale=None, w2_scale=None),
        ),
        "float_w2": ("w2 must be float8_e4m3fn, got float32", replace(w2=layer.w2.float())),
    }


@pytest.mark.parametrize("case", list(_invalid_fp8_layers()))
def test_invalid_fp8_layer_raises_value_error(case: str) -> None:
    message, layer = _invalid_fp8_layers()[case]
    with pytest.raises(ValueError, match=message):
        validate_layer(layer)


def test_quantisation_error_bound() -> None:
    """e4m3 has 3 mantissa bits: a normal value rounds within 2^-4 of itself (relative); below
    e4m3's smallest normal (2^-6 in units of the block's scale) the subnormal step is 2^-9,
    so the error is at most 2^-10 scales."""
    g = torch.Generator().manual_seed(0)
    # Blocks of very different magnitudes, shapes not multiples of 128.
    w = torch.randn(3, 300, 200, generator=g) * torch.logspace(-4, 2, 300)[None, :, None]
    w[0, :128, :128] = 0.0  # an all-zero block
    q, scale = quantize(w)
    assert q.dtype == FP8_DTYPE and scale.shape == (3, 3, 2) and scale.dtype == torch.float32
    assert scale[0, 0, 0] == 1.0 and not q[0, :128, :128].float().any()
    deq = dequantize(q, scale, torch.float32)
    bound = 2**-4 * w.abs() + 2**-10 * expand_scales(scale, 300, 200)
    assert ((deq - w).abs() <= bound * (1 + 1e-6)).all()
    assert relative_error(deq, w) < 0.05
    assert dequantize(q, scale, torch.bfloat16).dtype == torch.bfloat16


def test_requantising_is_exact() -> None:
    """Dequantised weights quantise back to the same FP8 values and scales, bit for bit."""
    w = torch.randn(2, 256, 384, generator=torch.Generator().manual_seed(1)) * 3.0
    q, scale = quantize(w)
    q2, scale2 = quantize(dequantize(q, scale, torch.float32))
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(scale2, scale)
