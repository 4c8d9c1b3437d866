"""The explicit data that the MoE entry point takes, and its validation.

Everything the kernels need travels in these frozen dataclasses: the layer's weights, the LoRA
slot buffers with the per-token slot ids, and (optionally) a precomputed routing. Nothing is
read from globals. ``validate_forward_inputs`` is the one place that checks shapes, dtypes and
devices; it raises ``ValueError`` with a message a person can act on (the executor maps it to
gRPC ``INVALID_ARGUMENT``). It never synchronises the GPU: index *values* (expert ids, slot ids)
are range-checked only for tensors that live on the CPU.

Shapes use these letters: T tokens, H hidden size, E experts, I expert intermediate size,
k experts per token, S LoRA slots, R the slots' (maximum) rank, Is shared-expert intermediate size.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

#: Dtypes the hidden states and the expert / LoRA weights may have.
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
#: Dtype of block-quantised expert weights (DeepSeek-V3/R1 and Qwen3 "-FP8" checkpoints).
FP8_DTYPE = torch.float8_e4m3fn
#: Rows and columns of weight that share one FP8 scale (the checkpoints' weight_block_size).
FP8_BLOCK = 128


class Activation(enum.Enum):
    """How an expert turns its ``[gate; up]`` projection into the input of ``w2``."""

    #: ``silu(gate) * up`` (Qwen, Mixtral, OLMoE, DeepSeek).
    SILU = "silu"
    #: ``(up.clamp(-l, l) + 1) * g * sigmoid(alpha * g)`` with ``g = gate.clamp(max=l)`` (gpt_oss).
    GPT_OSS = "gpt_oss"


class RouterKind(enum.Enum):
    """How router logits become top-k expert ids and weights (see ``kernels.routing``)."""

    #: softmax (fp32) over all experts, then top-k, renormalised iff ``renormalize``
    #: (qwen2_moe / qwen3_moe / olmoe: ``norm_topk_prob``; mixtral: always).
    SOFTMAX_TOPK = "softmax_topk"
    #: top-k on the raw logits (router bias included), then softmax over the k (gpt_oss).
    TOPK_SOFTMAX = "topk_softmax"
    #: sigmoid scores, group-limited top-k on ``scores + e_score_correction_bias`` (deepseek_v3).
    SIGMOID_GROUPED_TOPK = "sigmoid_grouped_topk"


@dataclass(frozen=True)
class RouterSpec:
    """The router's hyper-parameters (from the model's config.json)."""

    kind: RouterKind
    top_k: int
    renormalize: bool
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0


@dataclass(frozen=True)
class SharedExpertWeights:
    """An always-on dense expert added to the routed output (qwen2_moe, deepseek_v3).

    w13:  (2*Is, H) rows ``[gate; up]``.
    w2:   (H, Is).
    gate: (1, H) or None; qwen2_moe scales the shared output by ``sigmoid(x @ gate.T)``.
    """

    w13: torch.Tensor
    w2: torch.Tensor
    gate: torch.Tensor | None = None


@dataclass(frozen=True)
class MoELayerWeights:
    """One MoE layer: router and experts, in the kernels' layout.

    router_weight:          (E, H)
    router_bias:            (E,) or None (gpt_oss has one)
    e_score_correction_bias (E,) or None (deepseek_v3's selection bias)
    w13:                    (E, 2*I, H) rows ``[gate; up]``, dtype of the hidden states
                            (or FP8_DTYPE with w13_scale)
    w2:                     (E, H, I), same dtype
    b13:                    (E, 2*I) or None (gpt_oss)
    b2:                     (E, H) or None (gpt_oss)
    w13_scale:              (E, ceil(2I/128), ceil(H/128)) float32, or None: with it, w13 is
                            FP8 and its value is ``w13[e, n, k] * w13_scale[e, n // 128, k // 128]``
                            (the checkpoints' ``weight_scale_inv``)
    w2_scale:               (E, ceil(H/128), ceil(I/128)) float32, given with w13_scale
    fp8_activations:        FP8 experts only: their GEMMs take their inputs quantised to FP8
                            per row and 128 columns (``kernels.fp8_activations``; W8A8, the
                            numerics of DeepSeek-V3's reference) on the FP8 tensor cores; else
                            they take them in the compute dtype (W8A16)

    The compute dtype (``dtype``) is that of the router weight; with FP8 experts the hidden
    states, LoRA and shared expert use it.
    """

    router: RouterSpec
    router_weight: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    activation: Activation = Activation.SILU
    router_bias: torch.Tensor | None = None
    e_score_correction_bias: torch.Tensor | None = None
    b13: torch.Tensor | None = None
    b2: torch.Tensor | None = None
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    shared: SharedExpertWeights | None = None
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None
    fp8_activations: bool = False

    @property
    def fp8(self) -> bool:
        """Whether the routed experts are FP8 with 128×128 block scales."""
        return self.w13_scale is not None

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype: the hidden states', LoRA's and the output's."""
        return self.router_weight.dtype if self.fp8 else self.w13.dtype

    @property
    def weight_format(self) -> str:
        """How the routed experts are stored: "fp8_e4m3_block128" ("..._w8a8" where their
        inputs are quantised too), or the dtype's name."""
        if not self.fp8:
            return str(self.w13.dtype).removeprefix("torch.")
        return "fp8_e4m3_block128_w8a8" if self.fp8_activations else "fp8_e4m3_block128"

    @property
    def num_experts(self) -> int:
        return int(self.w13.shape[0])

    @property
    def hidden_size(self) -> int:
        return int(self.w13.shape[2])

    @property
    def intermediate_size(self) -> int:
        return int(self.w13.shape[1]) // 2


@dataclass(frozen=True)
class LoRASlots:
    """Per-layer LoRA slot buffers, preallocated by the executor's slot manager.

    a13: (S, E, R, H)    b13: (S, E, 2*I, R)
    a2:  (S, E, R, I)    b2:  (S, E, H, R)
    enabled: (S,) int32, non-zero where the slot holds an adapter.

    The LoRA scaling is already folded into B; adapters of rank < R are zero-padded.
    """

    a13: torch.Tensor
    b13: torch.Tensor
    a2: torch.Tensor
    b2: torch.Tensor
    enabled: torch.Tensor

    @property
    def num_slots(self) -> int:
        return int(self.a13.shape[0])

    @property
    def max_rank(self) -> int:
        return int(self.a13.shape[2])


@dataclass(frozen=True)
class LoRAContext:
    """The LoRA state of one forward call.

    token_slots: (T,) int32, the slot of each token's adapter; -1 = no adapter. A token whose
    slot is disabled (``slots.enabled[s] == 0``) gets no LoRA either.
    """

    slots: LoRASlots
    token_slots: torch.Tensor


@dataclass(frozen=True)
class Routing:
    """Top-k routing of each token: topk_ids (T, k) int32, topk_weights (T, k) float32."""

    topk_ids: torch.Tensor
    topk_weights: torch.Tensor


def _check_shape(name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(tensor.shape)}")


def _check_dtype(name: str, tensor: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    if tensor.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        got = str(tensor.dtype).removeprefix("torch.")
        raise ValueError(f"{name} must be {allowed}, got {got}")


def _check_device(name: str, tensor: torch.Tensor, device: torch.device) -> None:
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device}, but the hidden states are on {device}")


def _check_range(name: str, tensor: torch.Tensor, low: int, high: int) -> None:
    """Range-check index values, only where that costs no GPU synchronisation."""
    if tensor.device.type == "cpu" and tensor.numel() > 0:
        lo, hi = int(tensor.min()), int(tensor.max())
        if lo < low or hi >= high:
            raise ValueError(f"{name} values must lie in [{low}, {high}), got [{lo}, {hi}]")


def _validate_router(spec: RouterSpec, num_experts: int) -> None:
    if not 1 <= spec.top_k <= num_experts:
        raise ValueError(f"router top_k must lie in [1, {num_experts}], got {spec.top_k}")
    if spec.kind is RouterKind.SIGMOID_GROUPED_TOPK:
        if spec.n_group < 1 or num_experts % spec.n_group:
            raise ValueError(f"n_group={spec.n_group} must divide the {num_experts} experts")
        if num_experts // spec.n_group < 2:
            raise ValueError("groups are scored by their top 2 experts: need >= 2 per group")
        if not 1 <= spec.topk_group <= spec.n_group:
            raise ValueError(f"topk_group must lie in [1, {spec.n_group}], got {spec.topk_group}")
        if spec.top_k > spec.topk_group * (num_experts // spec.n_group):
            raise ValueError(f"top_k={spec.top_k} exceeds the experts of {spec.topk_group} groups")


def _scale_blocks(rows: int, columns: int) -> tuple[int, int]:
    return -(-rows // FP8_BLOCK), -(-columns // FP8_BLOCK)


def _validate_fp8(layer: MoELayerWeights) -> None:
    e, h, i = layer.num_experts, layer.hidden_size, layer.intermediate_size
    if layer.w2_scale is None or layer.w13_scale is None:
        raise ValueError("FP8 experts need both w13_scale and w2_scale")
    _check_dtype("w13", layer.w13, (FP8_DTYPE,))
    _check_dtype("w2", layer.w2, (FP8_DTYPE,))
    _check_shape("w13_scale", layer.w13_scale, (e, *_scale_blocks(2 * i, h)))
    _check_shape("w2_scale", layer.w2_scale, (e, *_scale_blocks(h, i)))
    _check_dtype("w13_scale", layer.w13_scale, (torch.float32,))
    _check_dtype("w2_scale", layer.w2_scale, (torch.float32,))


def validate_layer(layer: MoELayerWeights) -> None:
    """Check the layer's tensors against each other."""
    if layer.w13.dim() != 3 or layer.w2.dim() != 3:
        shapes = f"{tuple(layer.w13.shape)} and {tuple(layer.w2.shape)}"
        raise ValueError(f"w13 and w2 must be 3-D, got {shapes}")
    e, h, i = layer.num_experts, layer.hidden_size, layer.intermediate_size
    device = layer.w13.device
    if layer.w13.shape[1] % 2:
        raise ValueError(f"w13 must be (E, 2*I, H) rows [gate; up], got {tuple(layer.w13.shape)}")
    _check_shape("w2", layer.w2, (e, h, i))
    if layer.fp8 or layer.w2_scale is not None:
        _validate_fp8(layer)
    elif layer.fp8_activations:
        raise ValueError("fp8_activations: the experts are not FP8 (no w13_scale, w2_scale)")
    else:
        _check_dtype("w13", layer.w13, FLOAT_DTYPES)
        _check_dtype("w2", layer.w2, (layer.w13.dtype,))
    _check_shape("router_weight", layer.router_weight, (e, h))
    _check_dtype("router_weight", layer.router_weight, FLOAT_DTYPES)
    optional = {
        "router_bias": (layer.router_bias, (e,)),
        "e_score_correction_bias": (layer.e_score_correction_bias, (e,)),
        "b13": (layer.b13, (e, 2 * i)),
        "b2": (layer.b2, (e, h)),
    }
    for name, (tensor, shape) in optional.items():
        if tensor is not None:
            _check_shape(name, tensor, shape)
            _check_dtype(name, tensor, FLOAT_DTYPES)
    tensors: dict[str, torch.Tensor | None] = {
        "w2": layer.w2,
        "w13_scale": layer.w13_scale,
        "w2_scale": layer.w2_scale,
        "router_weight": layer.router_weight,
        **{name: tensor for name, (tensor, _) in optional.items()},
    }
    grouped = layer.router.kind is RouterKind.SIGMOID_GROUPED_TOPK
    if grouped and layer.e_score_correction_bias is None:
        raise ValueError("the sigmoid grouped router needs e_score_correction_bias")
    _validate_router(layer.router, e)
    if layer.shared is not None:
        shared = layer.shared
        if shared.w13.dim() != 2 or shared.w13.shape[0] % 2:
            raise ValueError(f"shared w13 must be (2*Is, H), got {tuple(shared.w13.shape)}")
        i_shared = shared.w13.shape[0] // 2
        _check_shape("shared w13", shared.w13, (2 * i_shared, h))
        _check_shape("shared w2", shared.w2, (h, i_shared))
        _check_dtype("shared w13", shared.w13, FLOAT_DTYPES)
        _check_dtype("shared w2", shared.w2, (shared.w13.dtype,))
        tensors |= {"shared w13": shared.w13, "shared w2": shared.w2, "shared gate": shared.gate}
        if shared.gate is not None:
            _check_shape("shared gate", shared.gate, (1, h))
            _check_dtype("shared gate", shared.gate, FLOAT_DTYPES)
    for name, tensor in tensors.items():
        if tensor is not None and tensor.device != device:
            raise ValueError(f"{name} is on {tensor.device}, but w13 is on {device}")


def validate_forward_inputs(
    hidden: torch.Tensor,
    layer: MoELayerWeights,
    lora: LoRAContext | None = None,
    routing: Routing | None = None,
    *,
    check_layer: bool = True,
) -> None:
    """Check everything ``moe_forward`` takes; raise ValueError naming the offending tensor.

    ``check_layer=False`` skips ``validate_layer`` for a layer its owner validated once at
    load (the executor); the checks of the inputs against the layer still run.
    """
    if check_layer:
        validate_layer(layer)
    if hidden.dim() != 2:
        raise ValueError(f"hidden states must be (T, H), got shape {tuple(hidden.shape)}")
    _check_dtype("hidden states", hidden, FLOAT_DTYPES)
    t, h = hidden.shape
    if h != layer.hidden_size:
        raise ValueError(f"hidden states have H={h}, the layer has hidden size {layer.hidden_size}")
    if hidden.dtype != layer.dtype:
        raise ValueError(f"hidden states are {hidden.dtype}, the layer computes in {layer.dtype}")
    device = hidden.device
    _check_device("expert weights", layer.w13, device)
    e, i = layer.num_experts, layer.intermediate_size
    if routing is not None:
        k = layer.router.top_k
        _check_shape("topk_ids", routing.topk_ids, (t, k))
        _check_shape("topk_weights", routing.topk_weights, (t, k))
        _check_dtype("topk_ids", routing.topk_ids, (torch.int32,))
        _check_dtype("topk_weights", routing.topk_weights, (torch.float32,))
        _check_device("topk_ids", routing.topk_ids, device)
        _check_device("topk_weights", routing.topk_weights, device)
        _check_range("topk_ids", routing.topk_ids, 0, e)
    if lora is not None:
        slots = lora.slots
        if slots.a13.dim() != 4:
            raise ValueError(f"LoRA a13 must be (S, E, R, H), got {tuple(slots.a13.shape)}")
        s, r = slots.num_slots, slots.max_rank
        expected = {
            "LoRA a13": (slots.a13, (s, e, r, h)),
            "LoRA b13": (slots.b13, (s, e, 2 * i, r)),
            "LoRA a2": (slots.a2, (s, e, r, i)),
            "LoRA b2": (slots.b2, (s, e, h, r)),
        }
        for name, (tensor, shape) in expected.items():
            _check_shape(name, tensor, shape)
            _check_dtype(name, tensor, (hidden.dtype,))
            _check_device(name, tensor, device)
        if r < 1:
            raise ValueError("LoRA slots must have rank >= 1")
        _check_shape("LoRA enabled", slots.enabled, (s,))
        _check_dtype("LoRA enabled", slots.enabled, (torch.int32,))
        _check_device("LoRA enabled", slots.enabled, device)
        _check_shape("token_slots", lora.token_slots, (t,))
        _check_dtype("token_slots", lora.token_slots, (torch.int32,))
        _check_device("token_slots", lora.token_slots, device)
        _check_range("token_slots", lora.token_slots, -1, s)
