"""Compile candidate configurations in parallel worker processes, before they are timed.

Triton compiles a kernel on its first launch and keeps the binary in its on-disk cache, so
a worker that launches a configuration once leaves it compiled for the timing process. The
workers are spawned (CUDA cannot be forked) and hold a copy of the layer with at most
as many experts as fit ``WORKER_BYTES`` (at least k; a 256-expert layer would take gigabytes in
every worker, and 14 workers ran an H100 out of memory): the
routing then hits only those, while the alignment is still computed for the full expert
count, so every integer a kernel is specialised on (block counts, strides modulo 16) matches
the timing process's launch and the cache key is the same.
"""

from __future__ import annotations

import json
import multiprocessing
import time
from dataclasses import dataclass

import torch

from kernels.align import align_pairs
from kernels.configs import MoEConfig
from kernels.forward import fused_moe
from kernels.fused_moe import LoRABuffers, fused_experts
from kernels.synthetic import fp8_layer, random_layer
from kernels.types import Activation, MoELayerWeights

#: Expert weights one compile worker holds at most (beyond the k experts it needs).
WORKER_BYTES = 512 * 1024**2


@dataclass(frozen=True)
class CompileJob:
    """One launch to compile: the layer's shape and kernel-relevant features, a cell, a config."""

    experts: int
    hidden: int
    inter: int
    top_k: int
    activation: str
    biases: bool
    dtype: str  # the hidden states'
    fp8: bool  # FP8 experts (kernels.synthetic.fp8_layer)
    tokens: int
    rank: int
    num_slots: int
    config_json: str

    @staticmethod
    def of(
        layer: MoELayerWeights, tokens: int, rank: int, num_slots: int, config: MoEConfig
    ) -> CompileJob:
        return CompileJob(
            layer.num_experts, layer.hidden_size, layer.intermediate_size, layer.router.top_k,
            layer.activation.value, layer.b13 is not None, str(layer.dtype).split(".")[-1],
            layer.fp8, tokens, rank, num_slots, json.dumps(config.to_json(), sort_keys=True),
        )  # fmt: skip


def worker_experts(job: CompileJob) -> int:
    """Experts a worker holds: as many as fit WORKER_BYTES, at least k, at most all."""
    weight_bits = 8 if job.fp8 else torch.finfo(getattr(torch, job.dtype)).bits
    per_expert = 3 * job.hidden * job.inter * weight_bits // 8
    return min(job.experts, max(job.top_k, WORKER_BYTES // per_expert))


def _worker_layer(job: CompileJob) -> MoELayerWeights:
    layer = random_layer(
        worker_experts(job), job.hidden, job.inter, job.top_k,
        dtype=getattr(torch, job.dtype), device="cuda",
        activation=Activation(job.activation), biases=job.biases,
    )  # fmt: skip
    return fp8_layer(layer) if job.fp8 else layer


def compile_job(job: CompileJob, layer: MoELayerWeights) -> list[torch.Tensor]:
    """Launch the job's configuration once with LoRA (if any) and once without, on ``layer``
    (of at most the job's experts); returns the outputs, LoRA first."""
    from kernels.autotune import CellInputs  # autotune imports this module

    config = MoEConfig.from_json(json.loads(job.config_json))
    inputs = CellInputs.make(layer, job.tokens, job.rank, job.num_slots, layer.num_experts)
    variants = [inputs.lora, None] if inputs.lora is not None else [None]
    outputs = []
    for lora in variants:
        if config.decode:  # no alignment: nothing depends on the expert count
            outputs.append(fused_moe(inputs.hidden, layer, lora, inputs.routing, config))
            continue
        alignment = align_pairs(
            inputs.routing.topk_ids, job.experts, config.block_m,
            token_slots=None if lora is None else lora.token_slots,
            enabled=None if lora is None else lora.slots.enabled,
        )  # fmt: skip
        buffers = None
        if lora is not None and alignment.row_slots is not None:
            s = lora.slots
            buffers = LoRABuffers(s.a13, s.b13, s.a2, s.b2, alignment.row_slots)
        outputs.append(fused_experts(
            inputs.hidden, layer.w13, layer.w2, layer.b13, layer.b2, layer.activation,
            layer.swiglu_alpha, layer.swiglu_limit, inputs.routing.topk_weights,
            alignment, buffers, config, w13_scale=layer.w13_scale, w2_scale=layer.w2_scale,
        ))  # fmt: skip
    if layer.w13.is_cuda:
        torch.cuda.synchronize()
    return outputs


# One worker's layer, kept between its jobs (they come sorted by shape).
_LAYERS: dict[tuple[int, int, int, int, str, bool, str, bool], MoELayerWeights] = {}


def _run(job: CompileJob) -> str:
    key = (
        job.experts, job.hidden, job.inter, job.top_k, job.activation, job.biases, job.dtype,
        job.fp8,
    )  # fmt: skip
    try:
        if key not in _LAYERS:
            _LAYERS.clear()
            torch.cuda.empty_cache()
            _LAYERS[key] = _worker_layer(job)
        compile_job(job, _LAYERS[key])
        return ""
    except Exception as error:  # reported; the timing loop times the config as infinite
        return f"M={job.tokens} r={job.rank}: {type(error).__name__}: {error}"[:300]


def compile_all(jobs_list: list[CompileJob], processes: int, deadline: float) -> int:
    """Compile every job in ``processes`` spawned workers, stopping at ``deadline``
    (``time.monotonic()``); returns the number that failed or were left."""
    work = sorted(set(jobs_list), key=lambda j: (j.experts, j.hidden, j.inter, j.tokens))
    failed = 0
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        results = pool.imap_unordered(_run, work)
        for done in range(len(work)):
            left = deadline - time.monotonic()
            try:
                message = results.next(timeout=max(left, 0.0))
            except multiprocessing.TimeoutError:
                pool.terminate()
                return failed + len(work) - done
            if message:
                failed += 1
    return failed
