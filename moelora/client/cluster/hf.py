"""Hugging Face integration: a loaded ``AutoModelForCausalLM`` whose MoE blocks run on the
executors, so that ``model.generate()`` works unchanged with many adapters in one batch.

    model = AutoModelForCausalLM.from_pretrained("Qwen/Qwen3-30B-A3B", ...)
    cluster = ClusterClient(["dns:///executor-layers-0-23:50052", ...])
    experts = attach_remote_experts(model, cluster)
    with experts.using(["sql:2", None, "chat@prod"]):      # one adapter per batch row
        tokens = model.generate(input_ids, max_new_tokens=64, do_sample=False)

Each MoE block (``model.layers.{i}.mlp``) is replaced by a ``RemoteMoEBlock`` that sends the
block's hidden states, flattened to (batch·seq, H), with one segment per run of rows that
share an adapter, and returns the executor's output in the block's shape, dtype and device.
Attention, norms, dense layers and the LM head stay local. The model's own expert weights can
be dropped (``meta``-loaded) since they are never read. Requires transformers 5.x module
paths (``[transformers]`` extra); only the model's config and modules are used here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, Protocol, cast

import torch

from moelora.client.executor import ForwardResult
from moelora.client.layer_set import format_layers
from moelora.client.model_spec import spec_from_config

#: (num_tokens, adapter or None), as the executor clients take them.
SegmentList = list[tuple[int, str | None]]


class ForwardClient(Protocol):
    """What the remote blocks call: a ``ClusterClient`` or a single ``ExecutorClient``."""

    def forward(
        self, layer: int, hidden: torch.Tensor, segments: SegmentList | None = None
    ) -> ForwardResult[torch.Tensor]: ...


class RowAdapters:
    """The adapter of each batch row (None: base model) that the remote blocks use."""

    def __init__(self) -> None:
        self.rows: list[str | None] | None = None

    def segments(self, batch: int, seq: int) -> SegmentList:
        rows = self.rows if self.rows is not None else [None] * batch
        if len(rows) != batch:
            raise ValueError(
                f"remote experts: {len(rows)} adapters set for a batch of {batch} rows "
                "(beam search and num_return_sequences multiply rows: repeat the adapters)"
            )
        segments: SegmentList = []
        for adapter in rows:
            if segments and segments[-1][1] == adapter:
                segments[-1] = (segments[-1][0] + seq, adapter)
            else:
                segments.append((seq, adapter))
        return segments


class RemoteMoEBlock(torch.nn.Module):
    """Stands in for one decoder layer's MoE block; computes it on the executors."""

    def __init__(
        self, client: ForwardClient, layer: int, adapters: RowAdapters, router_scores: bool
    ) -> None:
        super().__init__()
        self.client = client
        self.layer = layer
        self.adapters = adapters
        #: gpt_oss's decoder layer unpacks (hidden, router_scores) from its MLP.
        self.router_scores = router_scores

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, None]:
        batch, seq, hidden = hidden_states.shape
        flat = hidden_states.detach().reshape(batch * seq, hidden)
        result = self.client.forward(self.layer, flat, self.adapters.segments(batch, seq))
        out = result.output.to(device=hidden_states.device, dtype=hidden_states.dtype)
        out = out.reshape(batch, seq, hidden)
        return (out, None) if self.router_scores else out


class RemoteExperts:
    """The remote blocks attached to one model, and the adapters they use."""

    def __init__(
        self, model: torch.nn.Module, originals: dict[int, torch.nn.Module], rows: RowAdapters
    ) -> None:
        self._model = model
        self._originals = originals
        self._rows = rows

    @property
    def layers(self) -> list[int]:
        return sorted(self._originals)

    def set_adapters(self, adapters: Sequence[str | None] | None) -> None:
        """One adapter reference (or None) per batch row; None: every row on the base model."""
        self._rows.rows = None if adapters is None else list(adapters)

    @contextlib.contextmanager
    def using(self, adapters: Sequence[str | None] | None) -> Iterator[None]:
        """``set_adapters`` for the duration of a ``with`` block."""
        previous = self._rows.rows
        self.set_adapters(adapters)
        try:
            yield
        finally:
            self._rows.rows = previous

    def detach(self) -> None:
        """Puts the model's own MoE blocks back."""
        for layer, block in self._originals.items():
            self._model.get_submodule(f"model.layers.{layer}").mlp = block
        self._originals = {}


def attach_remote_experts(
    model: torch.nn.Module, client: ForwardClient, served: Sequence[int] | None = None
) -> RemoteExperts:
    """Replaces every MoE block of ``model`` (a transformers 5.x causal LM of a supported MoE
    type) by a ``RemoteMoEBlock`` calling ``client``. ``served``: the layers the executors
    serve (default: ``client.layers()`` when the client has it); every MoE layer of the model
    must be among them, else ValueError naming the missing ones."""
    config: dict[str, Any] = cast(Any, model).config.to_dict()
    spec = spec_from_config(config, config_json="", checkpoint_dtype="", fingerprint="")
    if served is None:
        known = getattr(client, "layers", None)
        served = list(known()) if callable(known) else list(spec.moe_layers)
    missing = sorted(set(spec.moe_layers) - set(served))
    if missing:
        raise ValueError(
            f"the executors serve no replica of MoE layers {format_layers(missing)} of this "
            f"{spec.model_type} model (they serve {format_layers(served) or 'none'})"
        )
    rows = RowAdapters()
    originals: dict[int, torch.nn.Module] = {}
    for layer in spec.moe_layers:
        decoder = model.get_submodule(f"model.layers.{layer}")
        originals[layer] = cast(torch.nn.Module, decoder.mlp)
        decoder.mlp = RemoteMoEBlock(client, layer, rows, spec.model_type == "gpt_oss")
    return RemoteExperts(model, originals, rows)
