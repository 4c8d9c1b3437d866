"""Every supported model type's facts in one table: adding a model type is one entry here.

Each consumer branches on these fields, never on the type's name: ``moelora.client.model_spec``
(config keys, MoE layers, checkpoint tensor names and layout), ``shared.adapter_format`` (PEFT 2D
key names), ``executor_service.model_loader`` (router, activation, gate/up interleaving),
``executor_service.packer`` (the same interleaving for LoRA B), ``executor_service.synthetic`` (the
config.json transformers writes) and the test models. No torch here: the registry reads it.
docs/adapter-formats.md ("Adding a model type") lists what else a new type needs.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any


class ExpertLayout(enum.Enum):
    """How a checkpoint stores the routed experts."""

    #: One 2-D tensor per expert and projection.
    PER_EXPERT = "per_expert"
    #: transformers 5's in-memory layout: gate_up_proj (E, 2I, H) rows [gate; up],
    #: down_proj (E, H, I).
    FUSED = "fused"
    #: gpt_oss: gate_up_proj (E, H, 2I) gate/up interleaved, down_proj (E, I, H), with biases.
    FUSED_TRANSPOSED = "fused_transposed"


class RouterStyle(enum.Enum):
    """How router logits become top-k weights (the kernels' RouterKind of the same name)."""

    #: softmax over all experts, then top-k, renormalised iff norm_topk_prob.
    SOFTMAX_TOPK = "softmax_topk"
    #: top-k on the raw logits (router bias included), then softmax over the k.
    TOPK_SOFTMAX = "topk_softmax"
    #: sigmoid, group-limited top-k with a score-correction bias; reads n_group, topk_group and
    #: routed_scaling_factor from config.json.
    SIGMOID_GROUPED_TOPK = "sigmoid_grouped_topk"


class ExpertActivation(enum.Enum):
    """The expert MLP's activation (the kernels' Activation of the same name)."""

    #: silu(gate) * up; config.json hidden_act must be silu.
    SILU = "silu"
    #: gpt_oss's clamped SwiGLU with swiglu_alpha / swiglu_limit.
    GPT_OSS = "gpt_oss"


class MoELayerRule(enum.Enum):
    """Which decoder layers are MoE layers."""

    ALL = "all"
    #: qwen: every decoder_sparse_step-th layer not in mlp_only_layers.
    SPARSE_STEP = "sparse_step"
    #: deepseek: layers from first_k_dense_replace on, every moe_layer_freq-th.
    FIRST_K_DENSE = "first_k_dense"


@dataclass(frozen=True)
class SharedExpert:
    """A shared expert that every token goes through besides its routed experts."""

    #: Module under the MoE block: ``mlp.{module}.{gate,up,down}_proj.weight``.
    module: str
    #: config.json key of its width.
    width_key: str
    #: The key counts experts of moe_intermediate_size (deepseek's n_shared_experts).
    width_is_count: bool = False
    #: A (1, H) ``mlp.shared_expert_gate.weight`` scales it by sigmoid(x · gateᵀ) (qwen2_moe).
    gated: bool = False


@dataclass(frozen=True)
class ModelType:
    """One model type's checkpoint names and layout, routing, activation and PEFT names."""

    name: str
    #: transformers' architecture class name (config.json "architectures").
    architecture: str
    #: config.json key of the expert count transformers writes; num_experts and
    #: num_local_experts are accepted for every type.
    experts_key: str
    #: config.json key of the routed experts' intermediate width.
    intermediate_key: str
    router: RouterStyle
    activation: ExpertActivation = ExpertActivation.SILU
    #: Renormalise the top-k weights whatever config.json says (mixtral; gpt_oss's softmax
    #: over k does it).
    always_renormalize: bool = False
    #: norm_topk_prob when config.json lacks it.
    norm_topk_default: bool = False
    moe_layers: MoELayerRule = MoELayerRule.ALL
    shared_expert: SharedExpert | None = None
    #: The checkpoint layout transformers' save_pretrained writes. PER_EXPERT types also accept
    #: FUSED; a FUSED_TRANSPOSED type accepts only that.
    saved_layout: ExpertLayout = ExpertLayout.PER_EXPERT
    #: Module holding the experts (and router) in the per-expert layout; the fused layouts
    #: always use "mlp".
    per_expert_module: str = "mlp"
    #: Per-expert projection names (gate, up, down): checkpoint tensors and PEFT 2D modules.
    projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    #: Router module under the MoE block and whether it has a bias.
    router_module: str = "gate"
    router_bias: bool = False
    #: deepseek's ``gate.e_score_correction_bias`` (E,).
    score_correction_bias: bool = False
    #: The fused experts carry gate_up_proj_bias (E, 2I) and down_proj_bias (E, H).
    expert_biases: bool = False
    #: gate_up_proj interleaves gate and up along its 2I axis instead of stacking [gate; up].
    gate_up_interleaved: bool = False
    #: Module paths PEFT's 2D per-expert adapters use (``()``: PEFT has no 2D format for it).
    peft_2d_modules: tuple[str, ...] = ("mlp",)
    #: config.json fields the synthetic writer adds so transformers can build a tiny model
    #: (attention shapes and the like; the MoE fields come from the rest of the entry).
    extra_config: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    #: config.json needs layer_types, one "full_attention" per decoder layer.
    layer_types: bool = False

    @property
    def experts_keys(self) -> tuple[str, ...]:
        """Every config.json key that may give the expert count."""
        common = ("num_experts", "num_local_experts")
        return common if self.experts_key in common else (*common, self.experts_key)

    @property
    def checks_hidden_act(self) -> bool:
        return self.activation is ExpertActivation.SILU

    @property
    def grouped_routing(self) -> bool:
        return self.router is RouterStyle.SIGMOID_GROUPED_TOPK


_TYPES = (
    ModelType(
        name="qwen3_moe",
        architecture="Qwen3MoeForCausalLM",
        experts_key="num_local_experts",
        intermediate_key="moe_intermediate_size",
        router=RouterStyle.SOFTMAX_TOPK,
        moe_layers=MoELayerRule.SPARSE_STEP,
    ),
    ModelType(
        name="qwen2_moe",
        architecture="Qwen2MoeForCausalLM",
        experts_key="num_experts",
        intermediate_key="moe_intermediate_size",
        router=RouterStyle.SOFTMAX_TOPK,
        moe_layers=MoELayerRule.SPARSE_STEP,
        shared_expert=SharedExpert("shared_expert", "shared_expert_intermediate_size", gated=True),
    ),
    ModelType(
        name="olmoe",
        architecture="OlmoeForCausalLM",
        experts_key="num_experts",
        intermediate_key="intermediate_size",
        router=RouterStyle.SOFTMAX_TOPK,
    ),
    ModelType(
        name="mixtral",
        architecture="MixtralForCausalLM",
        experts_key="num_local_experts",
        intermediate_key="intermediate_size",
        router=RouterStyle.SOFTMAX_TOPK,
        always_renormalize=True,
        per_expert_module="block_sparse_moe",
        projections=("w1", "w3", "w2"),
        # PEFT names the module path as the checkpoint does, or as transformers 5 renames it.
        peft_2d_modules=("block_sparse_moe", "mlp"),
    ),
    ModelType(
        name="gpt_oss",
        architecture="GptOssForCausalLM",
        experts_key="num_local_experts",
        intermediate_key="intermediate_size",
        router=RouterStyle.TOPK_SOFTMAX,
        activation=ExpertActivation.GPT_OSS,
        always_renormalize=True,
        saved_layout=ExpertLayout.FUSED_TRANSPOSED,
        router_module="router",
        router_bias=True,
        expert_biases=True,
        gate_up_interleaved=True,
        peft_2d_modules=(),
        extra_config=MappingProxyType(
            {
                "swiglu_limit": 7.0,
                "rope_parameters": {"rope_type": "default", "rope_theta": 150000.0},
            }
        ),
        layer_types=True,
    ),
    ModelType(
        name="deepseek_v3",
        architecture="DeepseekV3ForCausalLM",
        experts_key="n_routed_experts",
        intermediate_key="moe_intermediate_size",
        router=RouterStyle.SIGMOID_GROUPED_TOPK,
        norm_topk_default=True,
        moe_layers=MoELayerRule.FIRST_K_DENSE,
        shared_expert=SharedExpert("shared_experts", "n_shared_experts", width_is_count=True),
        score_correction_bias=True,
        extra_config=MappingProxyType(
            {
                "q_lora_rank": 16,
                "kv_lora_rank": 16,
                "qk_rope_head_dim": 8,
                "qk_nope_head_dim": 8,
                "v_head_dim": 16,
            }
        ),
    ),
)

#: model_type (config.json) → its facts, in the order the docs list them.
MODEL_TYPES: Mapping[str, ModelType] = MappingProxyType({t.name: t for t in _TYPES})
SUPPORTED_MODEL_TYPES = tuple(MODEL_TYPES)
