"""Where a base checkpoint's MoE shape, routing and fingerprint are read (no torch).

``read_checkpoint(folder)`` reads ``config.json`` and the safetensors *headers* (single file or
sharded through ``model.safetensors.index.json``), checks that every MoE tensor the executor will
load exists with the right shape and a float dtype, and computes the fingerprint. The registry
(``adapterctl base-model register``) and the executor compute it independently from the same
folder and must agree, so everything here is deterministic.

Checkpoint layouts, as transformers 5.23 ``save_pretrained`` writes them (verified on tiny
random models of each type):

* qwen2_moe / qwen3_moe / olmoe / deepseek_v3: one tensor per expert,
  ``model.layers.{l}.mlp.experts.{e}.{gate,up,down}_proj.weight`` ((I, H), (I, H), (H, I)),
  router ``mlp.gate.weight`` (E, H); qwen2_moe adds ``mlp.shared_expert.{gate,up,down}_proj``
  and ``mlp.shared_expert_gate.weight`` (1, H); deepseek_v3 adds
  ``mlp.gate.e_score_correction_bias`` (E,) and ``mlp.shared_experts.{gate,up,down}_proj``.
* mixtral: per expert under ``block_sparse_moe``: ``experts.{e}.w1`` (gate), ``w3`` (up),
  ``w2`` (down), router ``block_sparse_moe.gate.weight``.
* gpt_oss: fused and transposed, ``mlp.experts.gate_up_proj`` (E, H, 2I) with gate/up
  interleaved along the last axis, ``gate_up_proj_bias`` (E, 2I), ``down_proj`` (E, I, H),
  ``down_proj_bias`` (E, H); router ``mlp.router.weight`` (E, H) and ``.bias`` (E,).

transformers' in-memory layout for the first four types (and mixtral, renamed to ``mlp``) is
fused, ``mlp.experts.gate_up_proj`` (E, 2I, H) rows [gate; up] and ``mlp.experts.down_proj``
(E, H, I); checkpoints saved that way load in transformers too, so that layout is accepted as
well (``ExpertLayout.FUSED``).

Fingerprint: ``"sha256:" + sha256(canonical JSON)`` of the model type, the MoE shape fields,
the sorted (name, dtype, shape) of every MoE tensor, and the sha256 of the router tensors' bytes
(weight, bias, score-correction bias, layer by layer). The router bytes make two checkpoints
with identical shapes (a base model and its fine-tune) differ while costing only E·H elements
per layer to read; tensor *offsets* are left out because they describe the file layout (shard
order), not the model.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moelora.client.errors import InvalidArgument
from moelora.client.json_fields import JsonFields, parse_json_object
from moelora.client.model_types import MODEL_TYPES, SUPPORTED_MODEL_TYPES, ModelType, MoELayerRule
from moelora.client.model_types import ExpertLayout as ExpertLayout  # re-exported: part of this API
from moelora.client.safetensors_header import SafetensorsHeader, TensorInfo, read_header
from moelora.client.tensors import DataType
from moelora.v1 import model_pb2

if TYPE_CHECKING:
    from moelora.client.tensors import DataTypeCode

#: The largest config.json accepted (the BaseModel message carries it verbatim).
MAX_CONFIG_BYTES = 1024 * 1024
#: Bounds on what a config.json may declare, checked before anything is sized by it (a request
#: registering a base model is not trusted to be reasonable); far above any model published.
MAX_LAYERS = 4096
MAX_EXPERTS = 8192
MAX_WIDTH = 1 << 20
MAX_SHARED_EXPERTS = 64
FINGERPRINT_VERSION = 1
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

#: safetensors dtype → the codec's name, for the dtypes expert weights may have.
_FLOAT_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
#: FP8 (e4m3) weights with one float32 scale per 128×128 block in ``<name>_scale_inv``
#: (DeepSeek-V3/R1 and Qwen3 "-FP8" checkpoints): routed and shared experts' projections only.
FP8_STORED_DTYPE = "F8_E4M3"
#: Rows and columns per scale (kernels.types.FP8_BLOCK; this package imports no kernels).
FP8_BLOCK = 128
FP8_CHECKPOINT_DTYPE = "float8_e4m3fn"
#: checkpoint_dtype name ↔ its wire code (FP8 is a checkpoint type only, never a Forward tensor).
_CHECKPOINT_DTYPE_CODES: dict[str, DataTypeCode] = {
    "bfloat16": DataType.DATA_TYPE_BFLOAT16,
    "float16": DataType.DATA_TYPE_FLOAT16,
    "float32": DataType.DATA_TYPE_FLOAT32,
    FP8_CHECKPOINT_DTYPE: DataType.DATA_TYPE_FLOAT8_E4M3,
}
_CHECKPOINT_DTYPE_NAMES: dict[DataTypeCode, str] = {
    code: name for name, code in _CHECKPOINT_DTYPE_CODES.items()
}
#: Every ``ModelSpec.checkpoint_dtype``.
CHECKPOINT_DTYPES = frozenset(_CHECKPOINT_DTYPE_CODES)


@dataclass(frozen=True)
class ModelSpec:
    """What adapters and requests are checked against: the MoE part of a base model."""

    model_type: str
    hidden_size: int
    moe_intermediate_size: int
    num_experts: int
    top_k: int
    num_layers: int
    #: Decoder-layer indices that are MoE layers, ascending.
    moe_layers: tuple[int, ...]
    #: Summed intermediate width of the shared expert(s); 0 when there are none.
    shared_expert_intermediate_size: int
    #: Renormalise the top-k weights (mixtral: always; gpt_oss: its softmax over k does it).
    norm_topk_prob: bool
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    swiglu_alpha: float
    swiglu_limit: float
    #: Element type of the expert weights in the checkpoint: bfloat16, float16, float32 or
    #: float8_e4m3fn (block-scaled FP8).
    checkpoint_dtype: str
    fingerprint: str
    #: config.json verbatim.
    config_json: str

    @property
    def config(self) -> dict[str, Any]:
        parsed: dict[str, Any] = json.loads(self.config_json)
        return parsed

    @property
    def type(self) -> ModelType:
        """The model type's facts (spec_from_config admits only types in the table)."""
        return MODEL_TYPES[self.model_type]

    @property
    def has_shared_expert_gate(self) -> bool:
        """qwen2_moe scales its shared expert by sigmoid(x · gateᵀ)."""
        shared = self.type.shared_expert
        return shared is not None and shared.gated

    def to_proto(self, name: str) -> model_pb2.BaseModel:
        return model_pb2.BaseModel(
            name=name,
            model_type=self.model_type,
            fingerprint=self.fingerprint,
            hidden_size=self.hidden_size,
            moe_intermediate_size=self.moe_intermediate_size,
            num_experts=self.num_experts,
            top_k=self.top_k,
            num_layers=self.num_layers,
            moe_layers=list(self.moe_layers),
            shared_expert_intermediate_size=self.shared_expert_intermediate_size,
            checkpoint_dtype=_CHECKPOINT_DTYPE_CODES[self.checkpoint_dtype],
            config_json=self.config_json,
        )

    @classmethod
    def from_proto(cls, message: model_pb2.BaseModel) -> ModelSpec:
        """Rebuild from a stored BaseModel; the shape fields must agree with its config_json."""
        spec = spec_from_config(
            parse_json_object(message.config_json.encode(), "BaseModel.config_json"),
            config_json=message.config_json,
            checkpoint_dtype=checkpoint_dtype_name(message.checkpoint_dtype),
            fingerprint=message.fingerprint,
        )
        stored = {
            "model_type": message.model_type,
            "hidden_size": message.hidden_size,
            "moe_intermediate_size": message.moe_intermediate_size,
            "num_experts": message.num_experts,
            "top_k": message.top_k,
            "num_layers": message.num_layers,
            "moe_layers": tuple(message.moe_layers),
            "shared_expert_intermediate_size": message.shared_expert_intermediate_size,
        }
        for field, value in stored.items():
            if getattr(spec, field) != value:
                raise InvalidArgument(
                    f"BaseModel.{field} is {value} but its config_json says {getattr(spec, field)}"
                )
        return spec


def checkpoint_dtype_name(code: DataTypeCode) -> str:
    """A BaseModel's checkpoint_dtype code → its name; InvalidArgument for others."""
    name = _CHECKPOINT_DTYPE_NAMES.get(code)
    if name is None:
        allowed = ", ".join(DataType.Name(c) for c in _CHECKPOINT_DTYPE_NAMES)
        raise InvalidArgument(
            f"checkpoint_dtype: {code} is not a checkpoint weight type; use one of {allowed}",
            "checkpoint_dtype",
        )
    return name


def scale_name(weight_name: str) -> str:
    """The block-scale tensor of an FP8 weight (``….weight`` → ``….weight_scale_inv``)."""
    return f"{weight_name}_scale_inv"


def scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """(rows, columns) of a weight → (ceil(rows/128), ceil(columns/128)) of its scales."""
    return tuple(-(-size // FP8_BLOCK) for size in shape)


@dataclass(frozen=True)
class LayerTensors:
    """Checkpoint names of one MoE layer's tensors; None / () where the layout has none."""

    router_weight: str
    router_bias: str | None = None
    score_correction_bias: str | None = None
    #: Fused layouts.
    gate_up: str | None = None
    down: str | None = None
    gate_up_bias: str | None = None
    down_bias: str | None = None
    #: Per-expert layout, indexed by expert.
    expert_gate: tuple[str, ...] = ()
    expert_up: tuple[str, ...] = ()
    expert_down: tuple[str, ...] = ()
    shared_gate: str | None = None
    shared_up: str | None = None
    shared_down: str | None = None
    shared_expert_gate: str | None = None

    @property
    def router_tensors(self) -> tuple[str, ...]:
        """The tensors whose bytes go into the fingerprint."""
        names = (self.router_weight, self.router_bias, self.score_correction_bias)
        return tuple(name for name in names if name is not None)

    @property
    def expert_tensors(self) -> tuple[str, ...]:
        names = (self.gate_up, self.down, *self.expert_gate, *self.expert_up, *self.expert_down)
        return tuple(name for name in names if name is not None)

    @property
    def projection_tensors(self) -> tuple[str, ...]:
        """The weights an FP8 checkpoint may quantise: routed and shared experts'."""
        shared = (self.shared_gate, self.shared_up, self.shared_down)
        return (*self.expert_tensors, *(name for name in shared if name is not None))


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor's bytes are: file offset ``data_start + info.begin`` of ``path``."""

    path: Path
    data_start: int
    info: TensorInfo


@dataclass(frozen=True)
class Checkpoint:
    """A checked checkpoint folder: the spec, the layout and where each MoE tensor lives."""

    folder: Path
    spec: ModelSpec
    layout: ExpertLayout
    layers: Mapping[int, LayerTensors]
    #: Every MoE tensor the executor loads, by checkpoint name.
    tensors: Mapping[str, StoredTensor]


def read_model_spec(folder: Path) -> ModelSpec:
    """The spec (with fingerprint) of a checkpoint folder."""
    return read_checkpoint(folder).spec


def read_checkpoint(folder: Path) -> Checkpoint:
    """Read config.json and the safetensors headers, check every MoE tensor, fingerprint."""
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise InvalidArgument(f"{folder}: no config.json")
    config_bytes = config_path.read_bytes()
    if len(config_bytes) > MAX_CONFIG_BYTES:
        raise InvalidArgument(f"{config_path}: larger than {MAX_CONFIG_BYTES} bytes")
    config = parse_json_object(config_bytes, str(config_path))
    config_json = config_bytes.decode("utf-8")
    draft = spec_from_config(
        config,
        config_json=config_json,
        checkpoint_dtype="float32",
        fingerprint="",
    )
    available = _tensor_index(folder)
    layout = _detect_layout(draft, available)
    layers = {layer: layer_tensors(draft, layer, layout) for layer in draft.moe_layers}
    tensors: dict[str, StoredTensor] = {}
    for names in layers.values():
        for name, shape in expected_shapes(draft, names).items():
            if name not in available:
                raise InvalidArgument(
                    f"checkpoint tensor {name} is missing ({draft.model_type}, "
                    f"{layout.value} experts)"
                )
            stored = available[name]
            info = stored.info
            if info.shape != shape:
                raise InvalidArgument(
                    f"checkpoint tensor {name} has shape {list(info.shape)}, expected {list(shape)}"
                )
            if info.dtype == FP8_STORED_DTYPE and name in names.projection_tensors:
                tensors[scale_name(name)] = _fp8_scales(name, shape, available)
            elif info.dtype not in _FLOAT_DTYPES:
                raise InvalidArgument(
                    f"checkpoint tensor {name} is {info.dtype}; BF16, F16 and F32 checkpoints "
                    "are supported, and F8_E4M3 expert weights with 128x128 block scales "
                    "(dequantize other quantized checkpoints first)"
                )
            tensors[name] = stored
    checkpoint_dtype = _expert_dtype(layers, tensors)
    if checkpoint_dtype == FP8_CHECKPOINT_DTYPE:
        _check_fp8_experts(draft, layout, next(iter(layers.values())).expert_tensors[0])
    fingerprint = _fingerprint(draft, layers, tensors)
    spec = replace(draft, checkpoint_dtype=checkpoint_dtype, fingerprint=fingerprint)
    return Checkpoint(folder, spec, layout, layers, tensors)


def spec_from_config(
    config: Mapping[str, Any], *, config_json: str, checkpoint_dtype: str, fingerprint: str
) -> ModelSpec:
    """The ModelSpec a config.json describes (tensor-level facts passed in)."""
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or model_type not in MODEL_TYPES:
        raise InvalidArgument(
            f"config.json model_type {model_type!r} is not supported; supported: "
            + ", ".join(SUPPORTED_MODEL_TYPES)
        )
    kind = MODEL_TYPES[model_type]
    get = JsonFields(config, f"config.json ({model_type})")
    num_layers = _bounded(get, "num_hidden_layers", MAX_LAYERS)
    num_experts = _num_experts(get, kind)
    moe_intermediate_size = _bounded(get, kind.intermediate_key, MAX_WIDTH)
    hidden_size = _bounded(get, "hidden_size", MAX_WIDTH)
    top_k = get.integer("num_experts_per_tok")
    if not 1 <= top_k <= num_experts:
        raise InvalidArgument(
            f"config.json num_experts_per_tok={top_k} must lie in [1, {num_experts}]"
        )
    if kind.checks_hidden_act and config.get("hidden_act", "silu") != "silu":
        raise InvalidArgument(
            f"config.json hidden_act {config.get('hidden_act')!r} is not supported (only silu)"
        )
    n_group, topk_group, scaling = 1, 1, 1.0
    if kind.grouped_routing:
        n_group = get.integer("n_group", default=1)
        topk_group = get.integer("topk_group", default=1)
        scaling = get.number("routed_scaling_factor", default=1.0)
        if n_group < 1 or num_experts % n_group or not 1 <= topk_group <= n_group:
            raise InvalidArgument(
                f"config.json n_group={n_group} must divide n_routed_experts={num_experts} "
                f"and topk_group={topk_group} must lie in [1, n_group]"
            )
    moe_layers = _moe_layers(get, kind.moe_layers, num_layers)
    shared = 0
    if kind.shared_expert is not None:
        width = get.integer(kind.shared_expert.width_key, default=0)
        if width > (MAX_SHARED_EXPERTS if kind.shared_expert.width_is_count else MAX_WIDTH):
            raise InvalidArgument(
                f"config.json {kind.shared_expert.width_key}={width} is larger than any model "
                "this server takes"
            )
        shared = width * moe_intermediate_size if kind.shared_expert.width_is_count else width
    if not moe_layers:
        raise InvalidArgument("config.json describes no MoE layer")
    return ModelSpec(
        model_type=kind.name,
        hidden_size=hidden_size,
        moe_intermediate_size=moe_intermediate_size,
        num_experts=num_experts,
        top_k=top_k,
        num_layers=num_layers,
        moe_layers=moe_layers,
        shared_expert_intermediate_size=shared,
        norm_topk_prob=kind.always_renormalize
        or get.flag("norm_topk_prob", default=kind.norm_topk_default),
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=scaling,
        swiglu_alpha=get.number("swiglu_alpha", default=1.702),
        swiglu_limit=get.number("swiglu_limit", default=7.0),
        checkpoint_dtype=checkpoint_dtype,
        fingerprint=fingerprint,
        config_json=config_json,
    )


def layer_tensors(spec: ModelSpec, layer: int, layout: ExpertLayout) -> LayerTensors:
    """The checkpoint tensor names of MoE layer ``layer``."""
    kind = spec.type
    base = f"model.layers.{layer}"
    experts = range(spec.num_experts)
    per_expert = layout is ExpertLayout.PER_EXPERT
    mlp = f"{base}.{kind.per_expert_module}" if per_expert else f"{base}.mlp"
    router = f"{mlp}.{kind.router_module}"
    names = LayerTensors(
        router_weight=f"{router}.weight",
        router_bias=f"{router}.bias" if kind.router_bias else None,
        score_correction_bias=(
            f"{router}.e_score_correction_bias" if kind.score_correction_bias else None
        ),
    )
    if per_expert:
        gate, up, down = kind.projections
        names = replace(
            names,
            expert_gate=tuple(f"{mlp}.experts.{e}.{gate}.weight" for e in experts),
            expert_up=tuple(f"{mlp}.experts.{e}.{up}.weight" for e in experts),
            expert_down=tuple(f"{mlp}.experts.{e}.{down}.weight" for e in experts),
        )
    else:
        names = replace(
            names, gate_up=f"{mlp}.experts.gate_up_proj", down=f"{mlp}.experts.down_proj"
        )
        if kind.expert_biases:
            names = replace(
                names,
                gate_up_bias=f"{mlp}.experts.gate_up_proj_bias",
                down_bias=f"{mlp}.experts.down_proj_bias",
            )
    if kind.shared_expert is not None and spec.shared_expert_intermediate_size:
        shared = f"{mlp}.{kind.shared_expert.module}"
        names = replace(
            names,
            shared_gate=f"{shared}.gate_proj.weight",
            shared_up=f"{shared}.up_proj.weight",
            shared_down=f"{shared}.down_proj.weight",
        )
        if kind.shared_expert.gated:
            names = replace(names, shared_expert_gate=f"{mlp}.shared_expert_gate.weight")
    return names


def expected_shapes(spec: ModelSpec, names: LayerTensors) -> dict[str, tuple[int, ...]]:
    """Every tensor of one layer with the shape the checkpoint must store it in."""
    h, i, e = spec.hidden_size, spec.moe_intermediate_size, spec.num_experts
    i_shared = spec.shared_expert_intermediate_size
    transposed = spec.type.saved_layout is ExpertLayout.FUSED_TRANSPOSED
    candidates: dict[str | None, tuple[int, ...]] = {
        names.router_weight: (e, h),
        names.router_bias: (e,),
        names.score_correction_bias: (e,),
        names.gate_up: (e, h, 2 * i) if transposed else (e, 2 * i, h),
        names.down: (e, i, h) if transposed else (e, h, i),
        names.gate_up_bias: (e, 2 * i),
        names.down_bias: (e, h),
        names.shared_gate: (i_shared, h),
        names.shared_up: (i_shared, h),
        names.shared_down: (h, i_shared),
        names.shared_expert_gate: (1, h),
    }
    shapes = {name: shape for name, shape in candidates.items() if name is not None}
    shapes |= {name: (i, h) for name in (*names.expert_gate, *names.expert_up)}
    shapes |= {name: (h, i) for name in names.expert_down}
    return shapes


def _num_experts(get: JsonFields, kind: ModelType) -> int:
    keys = kind.experts_keys
    values = {key: get.integer(key) for key in keys if get.has(key)}
    if not values:
        raise InvalidArgument(f"config.json ({kind.name}) lacks " + " or ".join(keys))
    if len(set(values.values())) > 1:
        raise InvalidArgument(f"config.json disagrees on the number of experts: {values}")
    count = next(iter(values.values()))
    if not 1 <= count <= MAX_EXPERTS:
        raise InvalidArgument(f"config.json says {count} experts; 1 to {MAX_EXPERTS} are taken")
    return count


def _bounded(get: JsonFields, key: str, most: int) -> int:
    """A declared size, refused before anything is sized by it when outside 1..``most``."""
    value = get.integer(key)
    if not 1 <= value <= most:
        raise InvalidArgument(
            f"config.json {key}={value} is outside 1-{most}, the sizes this server takes"
        )
    return value


def _moe_layers(get: JsonFields, rule: MoELayerRule, num_layers: int) -> tuple[int, ...]:
    if rule is MoELayerRule.SPARSE_STEP:
        skip = set(get.integer_list("mlp_only_layers", default=[]))
        step = get.integer("decoder_sparse_step", default=1)
        return tuple(n for n in range(num_layers) if n not in skip and (n + 1) % step == 0)
    if rule is MoELayerRule.FIRST_K_DENSE:
        first_dense = get.integer("first_k_dense_replace", default=0)
        # transformers ignores moe_layer_freq; DeepSeek's code honours it (1 in practice).
        freq = get.integer("moe_layer_freq", default=1)
        return tuple(n for n in range(num_layers) if n >= first_dense and n % freq == 0)
    return tuple(range(num_layers))


def _tensor_index(folder: Path) -> dict[str, StoredTensor]:
    """Every tensor of the checkpoint → (its file, its header entry)."""
    index_path = folder / INDEX_FILE
    if index_path.is_file():
        index = parse_json_object(index_path.read_bytes(), str(index_path))
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) for v in weight_map.values()
        ):
            raise InvalidArgument(f"{index_path}: weight_map must map tensor names to file names")
        for file_name in set(weight_map.values()):
            if Path(file_name).name != file_name or file_name.startswith("."):
                raise InvalidArgument(f"{index_path}: {file_name!r} is not a plain file name")
        files = sorted(set(weight_map.values()))
    elif (folder / SINGLE_FILE).is_file():
        weight_map, files = {}, [SINGLE_FILE]
    else:
        raise InvalidArgument(f"{folder}: neither {SINGLE_FILE} nor {INDEX_FILE}")
    headers: dict[str, SafetensorsHeader] = {}
    for file_name in files:
        if not (folder / file_name).is_file():
            raise InvalidArgument(f"{folder}: shard {file_name} named in {INDEX_FILE} is missing")
        headers[file_name] = read_header(folder / file_name)
    available: dict[str, StoredTensor] = {}
    for file_name, header in headers.items():
        for name, info in header.tensors.items():
            if weight_map and weight_map.get(name) != file_name:
                continue  # the index is authoritative about where a tensor lives
            available[name] = StoredTensor(folder / file_name, header.data_start, info)
    return available


def _detect_layout(spec: ModelSpec, available: Mapping[str, Any]) -> ExpertLayout:
    fused = f"model.layers.{spec.moe_layers[0]}.mlp.experts.gate_up_proj"
    if spec.type.saved_layout is ExpertLayout.FUSED_TRANSPOSED:
        if f"{fused}_blocks" in available:
            raise InvalidArgument(
                f"checkpoint tensor {fused} is MXFP4-quantized ({fused}_blocks); "
                "dequantize the checkpoint to bf16 first"
            )
        return ExpertLayout.FUSED_TRANSPOSED
    return ExpertLayout.FUSED if fused in available else ExpertLayout.PER_EXPERT


def _check_fp8_experts(spec: ModelSpec, layout: ExpertLayout, first: str) -> None:
    """What the kernels' FP8 layout needs of the routed experts (``first``: one of them)."""
    if layout is not ExpertLayout.PER_EXPERT:
        raise InvalidArgument(
            f"checkpoint tensor {first} is F8_E4M3 in the {layout.value} layout; FP8 experts "
            "are read as saved per expert (as DeepSeek-V3 and Qwen3-FP8 ship them)"
        )
    if spec.moe_intermediate_size % FP8_BLOCK:
        raise InvalidArgument(
            f"FP8 experts need moe_intermediate_size to be a multiple of {FP8_BLOCK} (gate and "
            f"up scale blocks are stacked), got {spec.moe_intermediate_size}"
        )
    quantization = spec.config.get("quantization_config")
    block = [FP8_BLOCK, FP8_BLOCK]
    if isinstance(quantization, dict):
        block = quantization.get("weight_block_size", block)
    if block != [FP8_BLOCK, FP8_BLOCK]:
        raise InvalidArgument(
            f"config.json quantization_config.weight_block_size is {block}; FP8 checkpoints "
            f"with {FP8_BLOCK}x{FP8_BLOCK} blocks are supported"
        )


def _fp8_scales(
    name: str, shape: tuple[int, ...], available: Mapping[str, StoredTensor]
) -> StoredTensor:
    """The checked block scales of the FP8 weight ``name``."""
    scales = scale_name(name)
    if scales not in available:
        raise InvalidArgument(f"checkpoint tensor {scales} is missing (the scales of FP8 {name})")
    stored = available[scales]
    expected = scale_shape(shape)
    if stored.info.shape != expected or stored.info.dtype != "F32":
        raise InvalidArgument(
            f"checkpoint tensor {scales} is {stored.info.dtype} {list(stored.info.shape)}, "
            f"expected F32 {list(expected)}"
        )
    return stored


def _expert_dtype(layers: Mapping[int, LayerTensors], tensors: Mapping[str, StoredTensor]) -> str:
    dtypes = {
        name: tensors[name].info.dtype for names in layers.values() for name in names.expert_tensors
    }
    first_name, first = next(iter(dtypes.items()))
    for name, dtype in dtypes.items():
        if dtype != first:
            raise InvalidArgument(
                f"checkpoint tensor {name} is {dtype} but {first_name} is {first}: "
                "expert weights must share one dtype"
            )
    return FP8_CHECKPOINT_DTYPE if first == FP8_STORED_DTYPE else _FLOAT_DTYPES[first]


def _fingerprint(
    spec: ModelSpec,
    layers: Mapping[int, LayerTensors],
    tensors: Mapping[str, StoredTensor],
) -> str:
    router = hashlib.sha256()
    for layer in spec.moe_layers:
        for name in layers[layer].router_tensors:
            stored = tensors[name]
            with stored.path.open("rb") as f:
                f.seek(stored.data_start + stored.info.begin)
                router.update(f.read(stored.info.nbytes))
    document = {
        "fingerprint_version": FINGERPRINT_VERSION,
        "model_type": spec.model_type,
        "hidden_size": spec.hidden_size,
        "moe_intermediate_size": spec.moe_intermediate_size,
        "num_experts": spec.num_experts,
        "top_k": spec.top_k,
        "moe_layers": list(spec.moe_layers),
        "shared_expert_intermediate_size": spec.shared_expert_intermediate_size,
        "tensors": sorted(
            [name, stored.info.dtype, list(stored.info.shape)] for name, stored in tensors.items()
        ),
        "router_sha256": router.hexdigest(),
    }
    canonical = json.dumps(document, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()
