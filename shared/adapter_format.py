"""Where PEFT LoRA adapters are understood and checked against a base model (no torch).

``inspect_adapter`` decides, from adapter_config.json and the safetensors header alone, which
base parameter every LoRA pair adapts, with which rank and scaling, and rejects anything the
executor could not serve exactly as PEFT would (``InvalidArgument`` naming the key).

Two on-disk formats (facts checked against transformers 5.23 / peft 0.21):

* **3D ``target_parameters``** (what PEFT writes for transformers-5 MoE models), keys
  ``base_model.model.model.layers.{l}.mlp.experts[.base_layer].lora_{A,B}.weight`` with
  A (r·E, in) and B (out, r·E): gate_up_proj in=H, out=2I; down_proj in=I, out=H (gpt_oss
  too: PEFT treats its transposed parameters as (E, in, out)). The nesting (``base_layer``) only
  says which parameter was wrapped first, so the parameter is decided by the shapes (they
  cannot be confused: gate_up needs B rows 2I, down needs B rows H and A columns I) and must be
  one that ``target_parameters`` names.
* **2D per expert** (transformers-4-era adapters and other tools):
  ``...layers.{l}.mlp.experts.{e}.{gate_proj,up_proj,down_proj}.lora_{A,B}.weight`` (mixtral:
  ``block_sparse_moe.experts.{e}.{w1,w3,w2}``), A (r, in), B (out, r); every expert present.
  gate and up are packed into one w13 LoRA of rank r_gate + r_up with a block-diagonal B —
  exactly what PEFT does when it loads such an adapter — so that *sum* must fit the
  executor's max rank.

Rank and alpha per parameter follow PEFT: ``rank_pattern`` / ``alpha_pattern`` keys are regexes
matched as ``re.match(rf"(.*\\.)?({pattern})$", key)`` against the module key
(``model.layers.{l}.mlp.experts.gate_up_proj`` for 3D, ``model.layers.{l}.mlp.experts.{e}.
gate_proj`` for 2D), the first matching pattern wins; scaling = alpha / r, or alpha / sqrt(r)
with ``use_rslora``. The patterns come from untrusted uploads, so they are compiled by RE2
(linear-time matching; no backreferences or lookaround, which PEFT's patterns do not use),
not by Python's backtracking ``re``.
"""

from __future__ import annotations

import enum
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import re2

from moelora.client.errors import InvalidArgument
from moelora.client.json_fields import JsonFields, parse_json_object
from moelora.client.model_spec import ModelSpec
from moelora.client.safetensors_header import SafetensorsHeader

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
#: The largest adapter_config.json accepted.
MAX_CONFIG_BYTES = 1024 * 1024
#: safetensors dtypes LoRA weights may have.
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
KEY_PREFIX = "base_model.model."

_KEY_3D = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(base_layer\.)?lora_([AB])\.weight")
_KEY_2D = re.compile(
    r"model\.layers\.(\d+)\.(mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.lora_([AB])\.weight"
)


class AdapterFormat(enum.Enum):
    TARGET_PARAMETERS = "target_parameters"
    PER_EXPERT = "per_expert"


class Projection(enum.Enum):
    """The base parameter a LoRA pair adapts (GATE_UP in 3D adapters, the others in 2D)."""

    GATE_UP = "gate_up_proj"
    GATE = "gate_proj"
    UP = "up_proj"
    DOWN = "down_proj"

    @property
    def packed(self) -> str:
        """The packed parameter it lands in: ``w13`` or ``w2``."""
        return "w2" if self is Projection.DOWN else "w13"


@dataclass(frozen=True)
class LoRAPair:
    """One lora_A / lora_B pair and how it is applied."""

    a_key: str
    b_key: str
    projection: Projection
    #: The expert of a 2D pair; None for a 3D pair, which covers all experts.
    expert: int | None
    rank: int
    alpha: float
    scaling: float
    #: First row of this pair inside the packed A (2D up_proj follows gate_proj).
    rank_offset: int


@dataclass(frozen=True)
class LayerLayout:
    """One MoE layer: packed ranks (0 = no LoRA there) and its pairs."""

    w13_rank: int
    w2_rank: int
    pairs: tuple[LoRAPair, ...]


@dataclass(frozen=True)
class AdapterLayout:
    """What an adapter is, once checked against a base model."""

    format: AdapterFormat
    layers: Mapping[int, LayerLayout]
    #: The largest packed rank (w13 or w2, any layer): what must fit an executor slot.
    rank: int
    #: adapter_config.json's defaults (rank_pattern / alpha_pattern may override per pair).
    r: int
    lora_alpha: float
    use_rslora: bool
    #: The packed parameters adapted somewhere: a subset of ("gate_up_proj", "down_proj").
    target_parameters: tuple[str, ...]
    #: safetensors dtype shared by all LoRA tensors.
    dtype: str


class Pattern(Protocol):
    """A compiled RE2 pattern (what ``re2.compile`` returns)."""

    @property
    def pattern(self) -> str: ...

    def match(self, text: str) -> object: ...

    def fullmatch(self, text: str) -> object: ...


@dataclass(frozen=True)
class LoRASettings:
    """adapter_config.json's LoRA hyper-parameters."""

    r: int
    lora_alpha: float
    use_rslora: bool
    #: rank_pattern / alpha_pattern entries in file order, each compiled as PEFT matches it.
    rank_pattern: tuple[tuple[Pattern, int], ...]
    alpha_pattern: tuple[tuple[Pattern, float], ...]
    target_parameters: tuple[str, ...]
    #: A list of names (or dot-suffixes), or one regex that must match the whole module key.
    target_modules: Pattern | tuple[str, ...]

    def rank_alpha(self, module_key: str) -> tuple[int, float]:
        """Rank and alpha of one module / parameter key: PEFT's ``get_pattern_key``, the first
        pattern that matches the end of the key wins."""
        rank = next((v for p, v in self.rank_pattern if p.match(module_key)), self.r)
        alpha = next((v for p, v in self.alpha_pattern if p.match(module_key)), self.lora_alpha)
        return rank, alpha

    def scaling(self, rank: int, alpha: float) -> float:
        """The factor PEFT multiplies B·A by."""
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank


def parse_adapter_config(data: bytes) -> dict[str, Any]:
    """adapter_config.json's bytes as a JSON object (size-limited)."""
    if len(data) > MAX_CONFIG_BYTES:
        raise InvalidArgument(f"{CONFIG_FILE} is larger than {MAX_CONFIG_BYTES} bytes")
    return parse_json_object(data, CONFIG_FILE)


def inspect_adapter(
    config: Mapping[str, Any], header: SafetensorsHeader, spec: ModelSpec, max_rank: int
) -> AdapterLayout:
    """Check a PEFT adapter against ``spec`` and say how to pack it; see the module docstring."""
    settings = read_lora_settings(config)
    if not header.tensors:
        raise InvalidArgument(f"{WEIGHTS_FILE} holds no tensors")
    dtype = _common_dtype(header)
    layout_format, matches = _classify_keys(header, spec)
    if layout_format is AdapterFormat.TARGET_PARAMETERS:
        layers = _inspect_3d(matches, header, spec, settings)
    else:
        layers = _inspect_2d(matches, header, spec, settings)
    for layer, layout in layers.items():
        for name, rank in (("gate_up_proj", layout.w13_rank), ("down_proj", layout.w2_rank)):
            if rank > max_rank:
                raise InvalidArgument(_rank_message(layer, name, layout, rank, max_rank))
    targets = tuple(
        name
        for name, used in (
            ("gate_up_proj", any(lay.w13_rank for lay in layers.values())),
            ("down_proj", any(lay.w2_rank for lay in layers.values())),
        )
        if used
    )
    return AdapterLayout(
        format=layout_format,
        layers=layers,
        rank=max(max(lay.w13_rank, lay.w2_rank) for lay in layers.values()),
        r=settings.r,
        lora_alpha=settings.lora_alpha,
        use_rslora=settings.use_rslora,
        target_parameters=targets,
        dtype=dtype,
    )


def check_finite(header: SafetensorsHeader, data: bytes | memoryview, data_offset: int = 0) -> None:
    """Raise InvalidArgument naming the first tensor that holds a NaN or an infinity.

    ``data`` holds the file from byte ``data_offset`` on: pass ``header.data_start`` with the
    data section alone, 0 with the whole file. Float dtypes are checked (bf16 through its bit
    pattern: exponent all ones); other dtypes have no NaN.
    """
    view = memoryview(data).cast("B")
    for name, info in sorted(header.tensors.items(), key=lambda item: item[1].begin):
        if info.dtype not in FLOAT_DTYPES or info.nbytes == 0:
            continue
        start = header.data_start + info.begin - data_offset
        if start < 0 or start + info.nbytes > len(view):
            raise InvalidArgument(f"tensor {name}: its bytes lie outside the data given")
        if not _all_finite(view[start : start + info.nbytes], info.dtype):
            raise InvalidArgument(f"tensor {name} contains NaN or Inf values")


#: Elements checked per step, bounding the temporary arrays.
_FINITE_CHUNK = 1 << 22
#: The largest |scaling · B| element accepted: float16's largest value, the narrowest dtype an
#: executor computes in (a larger one is infinite there, and NaN after the next product).
MAX_SCALED_WEIGHT = 65504.0


def check_scaled(
    layout: AdapterLayout, header: SafetensorsHeader, data: bytes | memoryview
) -> None:
    """Raise InvalidArgument naming the first lora_B whose elements, times the pair's scaling
    (lora_alpha / r), would exceed ``MAX_SCALED_WEIGHT``. ``data`` holds the whole file."""
    view = memoryview(data).cast("B")
    for layer in layout.layers.values():
        for pair in layer.pairs:
            info = header.tensors[pair.b_key]
            start = header.data_start + info.begin
            largest = _largest_magnitude(view[start : start + info.nbytes], info.dtype)
            if not math.isfinite(pair.scaling) or largest * abs(pair.scaling) > MAX_SCALED_WEIGHT:
                raise InvalidArgument(
                    f"tensor {pair.b_key}: scaled by lora_alpha / r = {pair.scaling:g} (alpha "
                    f"{pair.alpha:g}, rank {pair.rank}) its elements reach "
                    f"{largest * abs(pair.scaling):g}, beyond {MAX_SCALED_WEIGHT:g} (float16's "
                    "largest): outputs would be infinite"
                )


def _largest_magnitude(raw: memoryview, dtype: str) -> float:
    if dtype == "BF16":
        bits = np.frombuffer(raw, dtype="<u2")
        steps = (
            (bits[i : i + _FINITE_CHUNK].astype("<u4") << 16).view("<f4")
            for i in range(0, bits.size, _FINITE_CHUNK)
        )
    else:
        values = np.frombuffer(raw, dtype={"F16": "<f2", "F32": "<f4", "F64": "<f8"}[dtype])
        steps = (values[i : i + _FINITE_CHUNK] for i in range(0, values.size, _FINITE_CHUNK))
    return max((float(np.abs(step).max()) for step in steps if step.size), default=0.0)


def _all_finite(raw: memoryview, dtype: str) -> bool:
    if dtype == "BF16":
        bits = np.frombuffer(raw, dtype="<u2")
        return not any(
            np.any((bits[i : i + _FINITE_CHUNK] & 0x7F80) == 0x7F80)
            for i in range(0, bits.size, _FINITE_CHUNK)
        )
    values = np.frombuffer(raw, dtype={"F16": "<f2", "F32": "<f4", "F64": "<f8"}[dtype])
    return all(
        bool(np.isfinite(values[i : i + _FINITE_CHUNK]).all())
        for i in range(0, values.size, _FINITE_CHUNK)
    )


#: Limits on regexes from untrusted configs: RE2 matches in time linear in the key, and these
#: bound the patterns' number and size (and so the program RE2 builds for each).
MAX_PATTERNS = 1024
MAX_PATTERN_LENGTH = 256


def _re2_options() -> Any:
    options = re2.Options()
    options.log_errors = False  # a refused pattern is the client's error, not a log line
    return options


_RE2_OPTIONS = _re2_options()


def _compile(pattern: str, where: str, template: str) -> Pattern:
    """``template.format(pattern)`` compiled by RE2; InvalidArgument when RE2 refuses it
    (backreferences, lookaround, too large a program)."""
    if len(pattern) > MAX_PATTERN_LENGTH:
        raise InvalidArgument(f"{where} {pattern[:40]!r}… is longer than {MAX_PATTERN_LENGTH}")
    try:
        compiled: Pattern = re2.compile(template.format(pattern), options=_RE2_OPTIONS)
    except re2.error as err:
        reason = err.args[0].decode(errors="replace") if err.args else str(err)
        raise InvalidArgument(
            f"{where} {pattern!r} is not a regex RE2 accepts (no backreferences or "
            f"lookaround): {reason}"
        ) from None
    return compiled


def _patterns(
    raw: Mapping[str, Any], where: str, value: Callable[[JsonFields, str], float]
) -> tuple[tuple[Pattern, Any], ...]:
    if len(raw) > MAX_PATTERNS:
        raise InvalidArgument(f"{CONFIG_FILE} {where} has more than {MAX_PATTERNS} entries")
    fields = JsonFields(raw, f"{CONFIG_FILE} {where}")
    # PEFT: re.match(rf"(.*\.)?({key})$", module_key)
    return tuple(
        (_compile(key, f"{CONFIG_FILE} {where} pattern", r"(.*\.)?({})$"), value(fields, key))
        for key in raw
    )


def read_lora_settings(config: Mapping[str, Any]) -> LoRASettings:
    """Check and read adapter_config.json's LoRA fields."""
    get = JsonFields(config, CONFIG_FILE)
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise InvalidArgument(f"{CONFIG_FILE} peft_type must be LORA, got {peft_type!r}")
    for flag in ("use_dora", "fan_in_fan_out", "lora_bias"):
        if get.flag(flag, default=False):
            raise InvalidArgument(f"{CONFIG_FILE} {flag}=true is not supported")
    r = get.integer("r")
    if r < 1:
        raise InvalidArgument(f"{CONFIG_FILE} r must be at least 1, got {r}")
    target_modules: Pattern | tuple[str, ...]
    if isinstance(config.get("target_modules"), str):
        # PEFT: re.fullmatch(target_modules, module_key)
        target_modules = _compile(config["target_modules"], f"{CONFIG_FILE} target_modules", "{}")
    else:
        target_modules = tuple(get.string_list("target_modules"))
    settings = LoRASettings(
        r=r,
        lora_alpha=get.number("lora_alpha"),
        use_rslora=get.flag("use_rslora", default=False),
        rank_pattern=_patterns(get.mapping("rank_pattern"), "rank_pattern", JsonFields.integer),
        alpha_pattern=_patterns(get.mapping("alpha_pattern"), "alpha_pattern", JsonFields.number),
        target_parameters=tuple(get.string_list("target_parameters")),
        target_modules=target_modules,
    )
    if any(rank < 1 for _, rank in settings.rank_pattern):
        raise InvalidArgument(f"{CONFIG_FILE} rank_pattern ranks must be at least 1")
    if not settings.target_parameters and not settings.target_modules:
        raise InvalidArgument(f"{CONFIG_FILE} names neither target_parameters nor target_modules")
    return settings


def _common_dtype(header: SafetensorsHeader) -> str:
    first_name, first = next(iter(header.tensors.items()))
    for name, info in header.tensors.items():
        if info.dtype not in FLOAT_DTYPES:
            raise InvalidArgument(
                f"tensor {name} is {info.dtype}; LoRA weights must be " + ", ".join(FLOAT_DTYPES)
            )
        if info.dtype != first.dtype:
            raise InvalidArgument(
                f"tensor {name} is {info.dtype} but {first_name} is {first.dtype}: "
                "all LoRA weights must share one dtype"
            )
    return first.dtype


def _check_layer(spec: ModelSpec, layer: int, key: str) -> None:
    if layer >= spec.num_layers:
        raise InvalidArgument(
            f"adapter key {key} is for layer {layer}, but the base model has "
            f"{spec.num_layers} layers"
        )
    if layer not in spec.moe_layers:
        raise InvalidArgument(
            f"adapter key {key} is for layer {layer}, which is not an MoE layer "
            f"(MoE layers: {list(spec.moe_layers)}); only expert LoRA can be served"
        )


def _pair_shapes(
    header: SafetensorsHeader, pair: Mapping[str, str]
) -> tuple[str, str, tuple[int, ...], tuple[int, ...]]:
    """Full keys and shapes of an A/B pair (short keys by letter), checked against each other."""
    if len(pair) < 2:
        ((letter, present),) = pair.items()
        other = "B" if letter == "A" else "A"
        missing = present.replace(f"lora_{letter}.", f"lora_{other}.")
        raise InvalidArgument(
            f"adapter tensor {KEY_PREFIX}{missing} is missing (LoRA needs A and B)"
        )
    a_key, b_key = KEY_PREFIX + pair["A"], KEY_PREFIX + pair["B"]
    a, b = header.tensors[a_key].shape, header.tensors[b_key].shape
    for key, shape in ((a_key, a), (b_key, b)):
        if len(shape) != 2:
            raise InvalidArgument(f"tensor {key} must be 2-D, got {list(shape)}")
    if a[0] != b[1]:
        raise InvalidArgument(
            f"tensor {a_key} has {a[0]} rank rows but {b_key} has {b[1]} rank columns"
        )
    if a[0] == 0:
        raise InvalidArgument(f"tensor {a_key} has rank 0")
    return a_key, b_key, a, b


def _inspect_3d(
    keys: Mapping[str, re.Match[str]],
    header: SafetensorsHeader,
    spec: ModelSpec,
    settings: LoRASettings,
) -> dict[int, LayerLayout]:
    h, i, e = spec.hidden_size, spec.moe_intermediate_size, spec.num_experts
    groups: dict[tuple[int, str], dict[str, str]] = {}
    for short, match in keys.items():
        layer = int(match[1])
        _check_layer(spec, layer, KEY_PREFIX + short)
        groups.setdefault((layer, match[2] or ""), {})[match[3]] = short
    found: dict[int, dict[Projection, LoRAPair]] = {}
    for (layer, _), pair in sorted(groups.items()):
        stem = f"model.layers.{layer}.mlp.experts"
        a_key, b_key, a, b = _pair_shapes(header, pair)
        if (a[1], b[0]) == (h, 2 * i):
            projection = Projection.GATE_UP
        elif (a[1], b[0]) == (i, h):
            projection = Projection.DOWN
        else:
            raise InvalidArgument(
                f"tensors {a_key} {list(a)} and {b_key} {list(b)} fit neither gate_up_proj "
                f"(A (r·{e}, {h}), B ({2 * i}, r·{e})) nor down_proj (A (r·{e}, {i}), "
                f"B ({h}, r·{e})) of the base model"
            )
        if a[0] % e:
            raise InvalidArgument(
                f"tensor {a_key} has {a[0]} rows, not a multiple of the {e} experts"
            )
        module_key = f"{stem}.{projection.value}"
        if not _targets_parameter(settings.target_parameters, module_key):
            raise InvalidArgument(
                f"tensor {a_key} adapts {projection.value}, which {CONFIG_FILE} "
                f"target_parameters {list(settings.target_parameters)} does not name"
            )
        layer_pairs = found.setdefault(layer, {})
        if projection in layer_pairs:
            raise InvalidArgument(f"tensor {a_key} adapts {module_key} a second time")
        rank, alpha = settings.rank_alpha(module_key)
        if a[0] // e != rank:
            raise InvalidArgument(
                f"tensor {a_key} has rank {a[0] // e} ({a[0]} rows / {e} experts) but "
                f"{CONFIG_FILE} gives {module_key} r={rank}"
            )
        layer_pairs[projection] = LoRAPair(
            a_key, b_key, projection, None, rank, alpha, settings.scaling(rank, alpha), 0
        )
    return {
        layer: LayerLayout(
            w13_rank=pairs[Projection.GATE_UP].rank if Projection.GATE_UP in pairs else 0,
            w2_rank=pairs[Projection.DOWN].rank if Projection.DOWN in pairs else 0,
            pairs=tuple(pairs.values()),
        )
        for layer, pairs in found.items()
    }


def _targets_parameter(target_parameters: tuple[str, ...], key: str) -> bool:
    """PEFT's matching of ``target_parameters`` entries against a parameter key."""
    return any(key == target or key.endswith(f".{target}") for target in target_parameters)


def _targets_module(target_modules: Pattern | tuple[str, ...], key: str) -> bool:
    """PEFT's ``check_target_module_exists`` for a plain list or a regex string."""
    if not isinstance(target_modules, tuple):
        return target_modules.fullmatch(key) is not None
    return any(key == target or key.endswith(f".{target}") for target in target_modules)


def _describe(target_modules: Pattern | tuple[str, ...]) -> str:
    if not isinstance(target_modules, tuple):
        return repr(target_modules.pattern)
    return str(list(target_modules))


def _names_2d(spec: ModelSpec) -> tuple[dict[str, Projection], tuple[str, ...]]:
    """The 2D projection names and module paths of a model type (none: no 2D format)."""
    kind = spec.type
    if not kind.peft_2d_modules:
        return {}, ()
    gate, up, down = kind.projections
    names = {gate: Projection.GATE, up: Projection.UP, down: Projection.DOWN}
    return names, kind.peft_2d_modules


def _classify_keys(
    header: SafetensorsHeader, spec: ModelSpec
) -> tuple[AdapterFormat, dict[str, re.Match[str]]]:
    """The adapter's format and each key (without the PEFT prefix) matched against it."""
    names, paths = _names_2d(spec)
    found: dict[AdapterFormat, dict[str, re.Match[str]]] = {fmt: {} for fmt in AdapterFormat}
    for key in header.tensors:
        short = key.removeprefix(KEY_PREFIX)
        match_3d, match_2d = _KEY_3D.fullmatch(short), _KEY_2D.fullmatch(short)
        if key.startswith(KEY_PREFIX) and match_3d is not None:
            found[AdapterFormat.TARGET_PARAMETERS][short] = match_3d
        elif (
            key.startswith(KEY_PREFIX)
            and match_2d is not None
            and match_2d[2] in paths
            and match_2d[4] in names
        ):
            found[AdapterFormat.PER_EXPERT][short] = match_2d
        else:
            per_expert = (
                f" or {KEY_PREFIX}model.layers.{{l}}.{paths[0]}.experts.{{e}}."
                f"{{{','.join(names)}}}.lora_A/B.weight"
                if names
                else ""
            )
            raise InvalidArgument(
                f"unknown adapter key {key}: only LoRA on the routed experts can be served "
                f"({KEY_PREFIX}model.layers.{{l}}.mlp.experts[.base_layer].lora_A/B.weight"
                f"{per_expert})"
            )
    three_d, two_d = found.values()
    if three_d and two_d:
        raise InvalidArgument(
            f"adapter mixes the 3D format ({KEY_PREFIX}{next(iter(three_d))}) and the 2D "
            f"per-expert format ({KEY_PREFIX}{next(iter(two_d))})"
        )
    fmt = AdapterFormat.TARGET_PARAMETERS if three_d else AdapterFormat.PER_EXPERT
    return fmt, found[fmt]


def _inspect_2d(
    keys: Mapping[str, re.Match[str]],
    header: SafetensorsHeader,
    spec: ModelSpec,
    settings: LoRASettings,
) -> dict[int, LayerLayout]:
    h, i, e = spec.hidden_size, spec.moe_intermediate_size, spec.num_experts
    names, _ = _names_2d(spec)
    # (layer, expert, projection) → {"A": short key, "B": short key}; the module path per layer.
    groups: dict[tuple[int, int, Projection], dict[str, str]] = {}
    module_paths: dict[int, str] = {}
    for short, match in keys.items():
        full = KEY_PREFIX + short
        layer, expert = int(match[1]), int(match[3])
        _check_layer(spec, layer, full)
        if expert >= e:
            raise InvalidArgument(f"adapter key {full} names expert {expert}; the model has {e}")
        if module_paths.setdefault(layer, match[2]) != match[2]:
            raise InvalidArgument(f"adapter key {full} mixes module paths within layer {layer}")
        groups.setdefault((layer, expert, names[match[4]]), {})[match[5]] = short
    short_names = {projection: name for name, projection in names.items()}
    adapted: dict[int, set[Projection]] = {}
    for layer, _, projection in groups:
        adapted.setdefault(layer, set()).add(projection)
    expected = {
        Projection.GATE: (h, i),
        Projection.UP: (h, i),
        Projection.DOWN: (i, h),
    }
    layers: dict[int, LayerLayout] = {}
    for layer in sorted(module_paths):
        stem = f"model.layers.{layer}.{module_paths[layer]}.experts"
        pairs: list[LoRAPair] = []
        w13_rank = w2_rank = 0
        for expert in range(e):
            offset = 0
            for projection in (Projection.GATE, Projection.UP, Projection.DOWN):
                if projection not in adapted[layer]:
                    continue
                module_key = f"{stem}.{expert}.{short_names[projection]}"
                pair = groups.get((layer, expert, projection))
                if pair is None:
                    raise InvalidArgument(
                        f"adapter tensor {KEY_PREFIX}{module_key}.lora_A.weight is missing: "
                        f"2D adapters need all {e} experts of every adapted projection"
                    )
                a_key, b_key, a, b = _pair_shapes(header, pair)
                want_in, want_out = expected[projection]
                if (a[1], b[0]) != (want_in, want_out):
                    raise InvalidArgument(
                        f"tensors {a_key} {list(a)} and {b_key} {list(b)} do not fit the base "
                        f"model: expected A (r, {want_in}) and B ({want_out}, r)"
                    )
                if not _targets_module(settings.target_modules, module_key):
                    raise InvalidArgument(
                        f"tensor {a_key} adapts {module_key}, which {CONFIG_FILE} "
                        f"target_modules {_describe(settings.target_modules)} does not name"
                    )
                rank, alpha = settings.rank_alpha(module_key)
                if a[0] != rank:
                    raise InvalidArgument(
                        f"tensor {a_key} has rank {a[0]} but {CONFIG_FILE} gives "
                        f"{module_key} r={rank}"
                    )
                scaling = settings.scaling(rank, alpha)
                if projection is Projection.DOWN:
                    pairs.append(
                        LoRAPair(a_key, b_key, projection, expert, rank, alpha, scaling, 0)
                    )
                    w2_rank = max(w2_rank, rank)
                else:
                    pairs.append(
                        LoRAPair(a_key, b_key, projection, expert, rank, alpha, scaling, offset)
                    )
                    offset += rank
                    w13_rank = max(w13_rank, offset)
        layers[layer] = LayerLayout(w13_rank=w13_rank, w2_rank=w2_rank, pairs=tuple(pairs))
    return layers


def _rank_message(layer: int, name: str, layout: LayerLayout, rank: int, max_rank: int) -> str:
    is_down = name == "down_proj"
    pair = max(
        (p for p in layout.pairs if (p.projection is Projection.DOWN) == is_down),
        key=lambda p: p.rank_offset + p.rank,
    )
    detail = ""
    if pair.expert is not None and not is_down:
        detail = " (2D gate_proj and up_proj ranks add up: they are packed block-diagonally)"
    return (
        f"tensor {pair.a_key}: layer {layer} {name} packs to rank {rank}{detail}, above the "
        f"executor's max rank {max_rank}"
    )
