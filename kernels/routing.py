"""Routers: hidden states → top-k expert ids and weights, as transformers 5.x computes them.

Read from transformers 5.23's modeling code:

* ``SOFTMAX_TOPK`` (qwen2_moe, qwen3_moe, olmoe, mixtral): logits = x Wᵀ in the model dtype,
  softmax in float32 over all experts, top-k, divide by the sum of the k iff ``renormalize``.
* ``TOPK_SOFTMAX`` (gpt_oss): logits = x Wᵀ + b in the model dtype, top-k on the raw logits,
  softmax over the k.
* ``SIGMOID_GROUPED_TOPK`` (deepseek_v3): logits = x Wᵀ in float32, scores = sigmoid(logits);
  choice scores = scores + e_score_correction_bias; a group's score is the sum of its top-2
  choice scores; the ``topk_group`` best groups are kept, the others' experts masked to -inf;
  top-k on the choice scores; the weights are the *unbiased* scores of the chosen experts,
  divided by (their sum + 1e-20) iff ``renormalize``.

The weights are then multiplied by ``routed_scaling_factor`` (1.0 everywhere but deepseek_v3)
and kept in float32 (transformers rounds them to the model dtype; the kernels take float32).
Expert selection, which decides which weights get read, matches transformers exactly: the
logits are computed in the same dtype by the same torch ops.
"""

from __future__ import annotations

import torch

from kernels.row_blocks import linear
from kernels.types import MoELayerWeights, RouterKind, Routing


def _grouped_topk(
    scores: torch.Tensor, correction_bias: torch.Tensor, n_group: int, topk_group: int, top_k: int
) -> torch.Tensor:
    """deepseek_v3's group-limited selection on biased scores; returns (T, k) expert ids."""
    t, e = scores.shape
    choice = scores + correction_bias.float()
    group_scores = choice.view(t, n_group, e // n_group).topk(2, dim=-1).values.sum(dim=-1)
    kept_groups = group_scores.topk(topk_group, dim=-1, sorted=False).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept_groups, True)
    expert_mask = group_mask.unsqueeze(-1).expand(t, n_group, e // n_group).reshape(t, e)
    choice = choice.masked_fill(~expert_mask, float("-inf"))
    return choice.topk(top_k, dim=-1, sorted=False).indices


def route(hidden: torch.Tensor, layer: MoELayerWeights) -> Routing:
    """Route each token of ``hidden`` (T, H) with ``layer``'s router.

    Returns topk_ids (T, k) int32 and topk_weights (T, k) float32 on hidden's device.
    """
    spec = layer.router
    weight = layer.router_weight
    if spec.kind is RouterKind.SOFTMAX_TOPK:
        logits = linear(hidden, weight.to(hidden.dtype))
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = probs.topk(spec.top_k, dim=-1)
        if spec.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    elif spec.kind is RouterKind.TOPK_SOFTMAX:
        bias = None if layer.router_bias is None else layer.router_bias.to(hidden.dtype)
        logits = linear(hidden, weight.to(hidden.dtype), bias)
        top_logits, ids = logits.topk(spec.top_k, dim=-1)
        weights = torch.softmax(top_logits, dim=-1, dtype=torch.float32)
    else:
        if layer.e_score_correction_bias is None:
            raise ValueError("the sigmoid grouped router needs e_score_correction_bias")
        scores = linear(hidden.float(), weight.float()).sigmoid()
        ids = _grouped_topk(
            scores, layer.e_score_correction_bias, spec.n_group, spec.topk_group, spec.top_k
        )
        weights = scores.gather(1, ids)
        if spec.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if spec.routed_scaling_factor != 1.0:
        weights = weights * spec.routed_scaling_factor
    return Routing(
        topk_ids=ids.to(torch.int32).contiguous(),
        topk_weights=weights.to(torch.float32).contiguous(),
    )
