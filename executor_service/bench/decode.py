"""Greedy decoding whose MoE blocks run on an executor, as a user of ``attach_remote_experts``
sees it: ``python -m executor_service.bench.decode``.

Builds a Qwen3-30B-A3B-shaped model (transformers' qwen3_moe: H=2048, 128 experts of I=768,
top-8, 32 heads, the real vocabulary; synthetic random weights) with ``--layers`` decoder
layers, every one MoE, saves it as the executor's checkpoint and starts the executor as its
own process. Then, per ``--batch``, times ``model.generate`` (greedy, ``--new-tokens`` after an
8-token prompt; time per output token = the call's wall time / new tokens, prefill included)
with the model's MoE blocks computed by:

- ``transformers``: the model's own experts (its grouped_mm implementation), for reference;
- ``kernels, in process``: this project's kernels on the same GPU, in the model's process (no
  adapter) — the fastest local path, what remote blocks are measured against;
- ``remote, message``: the executor, through an ``ExecutorClient`` that sends bytes;
- ``remote, device path``: the executor through the client's device path (a CUDA ring and a
  direct channel with a spin block: ``moelora.client.device_path``), where the executor can
  map its memory; ``remote, device path, socket``: the same with the channel's socket
  carrying the descriptors (``spin_channels=False``);
- ``remote, network channel``: the executor through a network channel (NCCL between two GPUs,
  Gloo on the CPU), when the model runs on another device than the executor
  (``--client-device``, e.g. ``cuda:1`` beside ``--device cuda:0``) or on the CPU.

Every variant's tokens are compared with the in-process kernels' (identical rows counted).
``--shape tiny --device cpu`` runs in seconds (a test runs it).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from executor_service.bench.processes import child_process, progress
from executor_service.model_loader import load_base_model
from kernels import MoELayerWeights, moe_forward
from moelora.client.cluster.hf import attach_remote_experts
from moelora.client.executor import ExecutorClient
from moelora.client.network_channel import NetworkChannel
from shared.ports import free_port

PROMPT = 8
#: transformers qwen3_moe configs: a Qwen3-30B-A3B layer, and a tiny one for the CPU.
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-30b-a3b": {
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
    },
    "tiny": {
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
    },
}


@dataclass(frozen=True)
class Row:
    variant: str
    batch: int
    ms_per_token: float
    #: Batch rows whose tokens equal the in-process kernels' run.
    same_rows: int
    transport: str = ""


class _LocalBlock(torch.nn.Module):
    """A MoE block computed by this project's kernels in the model's process."""

    def __init__(self, layer: MoELayerWeights, backend: str) -> None:
        super().__init__()
        self.layer = layer
        self.backend = backend

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = hidden_states.shape
        flat = hidden_states.reshape(batch * seq, hidden)
        out = moe_forward(flat, self.layer, backend=self.backend)  # type: ignore[arg-type]
        return out.reshape(batch, seq, hidden)


class _ChannelBlock(torch.nn.Module):
    """A MoE block computed by the executor through a network channel (no adapter)."""

    def __init__(self, layer: int, channel: NetworkChannel) -> None:
        super().__init__()
        self.layer = layer
        self.channel = channel

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = hidden_states.shape
        flat = hidden_states.reshape(batch * seq, hidden)
        out, _ = self.channel.forward(self.layer, flat)
        return out.reshape(batch, seq, hidden)


def _say(message: str) -> None:
    progress("decode", message)


def build_model(shape: str, layers: int, dtype: torch.dtype, device: torch.device) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen3_moe",
        **SHAPES[shape],
        num_hidden_layers=layers,
        norm_topk_prob=True,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)  # type: ignore[no-untyped-call]
    torch.nn.Module.eval(model)
    return model


def generate(model: Any, prompt: torch.Tensor, new_tokens: int) -> tuple[torch.Tensor, float]:
    """The new tokens (batch, new_tokens) and the call's seconds."""
    if prompt.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        tokens = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    if prompt.is_cuda:
        torch.cuda.synchronize()
    return tokens[:, prompt.shape[1] :].cpu(), time.perf_counter() - start


def _swap(model: Any, blocks: dict[int, torch.nn.Module]) -> dict[int, torch.nn.Module]:
    """Puts ``blocks`` in as the decoder layers' MLPs; returns the ones taken out."""
    taken = {}
    for index, block in blocks.items():
        decoder = model.get_submodule(f"model.layers.{index}")
        taken[index] = decoder.mlp
        decoder.mlp = block
    return taken


def run(args: argparse.Namespace) -> list[Row]:
    device = torch.device(args.client_device or args.device)  # the model's
    # NCCL takes no two ranks on one GPU: a network channel needs the model on another device.
    network = device.type == "cpu" or device != torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    batches = [int(b) for b in args.batch.split(",") if b]
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="bench-decode-") as tmp:
        root = Path(tmp)
        _say(f"building a {args.layers}-layer {args.shape} model")
        model = build_model(args.shape, args.layers, dtype, device)
        model.save_pretrained(root / "base")
        (root / "adapters").mkdir()
        loaded = load_base_model(root / "base", device, dtype)
        backend = "triton" if device.type == "cuda" else "torch"
        local: dict[int, torch.nn.Module] = {
            i: _LocalBlock(w, backend) for i, w in loaded.layers.items()
        }
        own = _swap(model, local)  # the model's own experts, put back for their row
        vocab = int(model.config.vocab_size)
        prompts = {
            b: torch.randint(1, vocab, (b, PROMPT), generator=torch.Generator().manual_seed(b))
            for b in batches
        }
        port = free_port()
        address = f"127.0.0.1:{port}"
        executor = [
            sys.executable, "-m", "executor_service.main",
            f"--listen={address}", "--metrics-listen=",
            f"--base-model-path={root / 'base'}", f"--adapter-dir={root / 'adapters'}",
            f"--device={args.device}", f"--dtype={args.dtype}",
            "--num-slots=2", "--max-rank=8", "--kernel-autotune-seconds=0",
            "--log-level=warning",
        ]  # fmt: skip
        if network:
            executor.append(f"--network-channel-port={free_port()}")
        env = {**os.environ, "MOELORA_REGISTRY_ADDRESS": ""}
        with (
            child_process(executor, env),
            ExecutorClient(address, timeout=600, device_path=False) as message,
            ExecutorClient(address, timeout=600) as fast,
            ExecutorClient(address, timeout=600, spin_channels=False) as socket_path,
            contextlib.ExitStack() as stack,
        ):
            message.wait_until_serving(timeout=600)
            _say("executor serving")

            def over_network() -> dict[int, torch.nn.Module]:
                channel = stack.enter_context(message.open_network_channel(device, timeout=600))
                return {i: _ChannelBlock(i, channel) for i in local}

            variants: list[tuple[str, Callable[[], dict[int, torch.nn.Module]], Callable[[], str]]]
            variants = [
                ("kernels, in process", lambda: local, str),
                ("transformers", lambda: own, str),
                ("remote, message", lambda: _remote(model, message), lambda: message.transport),
                ("remote, device path", lambda: _remote(model, fast), lambda: fast.transport),
                (
                    "remote, device path, socket",
                    lambda: _remote(model, socket_path),
                    lambda: socket_path.transport,
                ),
                ("remote, network channel", over_network, lambda: "network_channel"),
            ]
            expected: dict[int, torch.Tensor] = {}
            for name, blocks, transport in variants:
                if name.startswith("remote, device path") and device.type != "cuda":
                    continue  # CUDA memory needs a GPU
                if name == "remote, network channel" and not network:
                    continue
                if args.only and name not in args.only.split(";") and name != "kernels, in process":
                    continue  # the in-process row stays: the others' tokens are checked on it
                _swap(model, blocks())
                for batch in batches:
                    prompt = prompts[batch].to(device)
                    generate(model, prompt, 2)  # warm-up: kernels compiled, rings set up
                    tokens, seconds = generate(model, prompt, args.new_tokens)
                    expected.setdefault(batch, tokens)
                    same = sum(
                        bool(torch.equal(a, b))
                        for a, b in zip(tokens, expected[batch], strict=True)
                    )
                    rows.append(
                        Row(
                            name,
                            batch,
                            1e3 * seconds / args.new_tokens,
                            same,
                            transport(),
                        )
                    )
                    _say(f"row done: {rows[-1]}")
    return rows


def _remote(model: Any, client: ExecutorClient) -> dict[int, torch.nn.Module]:
    """The remote blocks for ``client`` (attached, and taken back out as a mapping)."""
    experts = attach_remote_experts(model, client)
    blocks = {i: model.get_submodule(f"model.layers.{i}").mlp for i in experts.layers}
    experts.detach()
    return blocks


def print_table(rows: list[Row], args: argparse.Namespace, device_name: str) -> None:
    print(
        f"\nGreedy decoding, {args.layers}-layer {args.shape} model (every layer MoE, "
        f"synthetic weights), {args.dtype}, {args.new_tokens} new tokens after {PROMPT}, on "
        f"{device_name}\n"
    )
    print("| MoE blocks | batch | ms per token | × in-process kernels | rows with its tokens |")
    print("|---|---:|---:|---:|---:|")
    base = {r.batch: r.ms_per_token for r in rows if r.variant == "kernels, in process"}
    for r in rows:
        ratio = r.ms_per_token / base[r.batch] if r.batch in base else float("nan")
        name = f"{r.variant} ({r.transport})" if r.transport else r.variant
        print(
            f"| {name} | {r.batch} | {r.ms_per_token:.2f} | {ratio:.2f} | {r.same_rows}/{r.batch} |"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--device", default="cuda", help="the executor's device")
    parser.add_argument(
        "--client-device",
        default="",
        help="the model's device (default: --device); another GPU adds a network-channel row",
    )
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--batch", default="1,64")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument(
        "--only",
        default="",
        help="the variants to run besides the in-process kernels, separated by ';' "
        '(e.g. "remote, device path;remote, message"); default: all',
    )
    args = parser.parse_args(argv)
    rows = run(args)
    device = torch.device(args.client_device or args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print_table(rows, args, name)


if __name__ == "__main__":
    main()
