"""Tune the launch configurations on this GPU: ``python -m kernels.tune``.

``--model PATH`` tunes the layer shape of a checkpoint (config.json; any supported model type),
``--shapes`` / ``--zoo`` the benchmark's shapes, for each of ``--ranks`` and every token bucket
the executor uses (``kernels.autotune.BUCKETS``), with ``kernels.autotune`` in ``--seconds``
per (shape, rank); ``--fp8`` tunes the shapes with FP8 experts instead (rows of their own,
``weights=fp8`` in the key). Results go to the on-disk cache the executor reads
(``--cache-dir``), or with ``--table`` into the shipped table of this GPU,
``kernels/configs/<GPU name>.json``. The first rank's configurations also serve the base model
(rank 0). The layer is random: the timings depend on the shape, not on the values.

``--refine`` searches only the program-layout knobs (persistent programs, w2's split K;
``kernels.autotune.refine``) around the rows this GPU's shipped table already has for
``--ranks`` (and the shapes given; without any, every shape in the table), and writes them;
``--refine hopper`` searches the Hopper kernels for each GEMM instead (on an sm_90 GPU).

The table of the earlier tuner (a from-scratch search, then ``--around-table`` stages) was made
by the version of this file at commit 02b4e9d.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path

import torch

from kernels.autotune import BUCKETS, autotune, refine
from kernels.bench import SHAPES, SLOTS, ZOO, default_cache_dir
from kernels.config_cache import ConfigCache
from kernels.configs import (
    MoEConfig,
    config_path,
    device_name,
    load_table,
    parse_table_key,
    table_key,
)
from kernels.model_shape import LayerShape, shape_from_checkpoint
from kernels.synthetic import fp8_layer, random_layer
from kernels.types import MoELayerWeights


def store_in_table(path: Path, shape: LayerShape, rank: int, configs: dict[int, MoEConfig]) -> None:
    """Merge ``configs`` into the shipped-table JSON at ``path`` (a row whose configuration
    is unchanged keeps its text: the table's diff shows what changed)."""
    table = json.loads(path.read_text()) if path.exists() else {}
    entry = table.setdefault(table_key(shape, rank), {})
    for tokens, config in configs.items():
        row = entry.get(str(tokens))
        if row is None or MoEConfig.from_json(row) != config:
            entry[str(tokens)] = config.to_json()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Tune kernels' launch configs on this GPU")
    parser.add_argument("--model", type=Path, help="checkpoint folder (or its config.json)")
    parser.add_argument("--shapes", default="", help="comma list of " + ",".join(SHAPES | ZOO))
    parser.add_argument("--zoo", action="store_true", help="tune the zoo shapes too")
    parser.add_argument("--ranks", default="16", help="LoRA ranks to tune (comma list)")
    parser.add_argument("--tokens", default=",".join(map(str, BUCKETS)), help="token buckets")
    parser.add_argument("--seconds", type=float, default=300.0, help="budget per shape and rank")
    parser.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1))
    parser.add_argument("--table", action="store_true", help="write the shipped GPU table")
    parser.add_argument(
        "--fp8", action="store_true", help="tune the shapes with FP8 experts (their own rows)"
    )
    parser.add_argument("--cache-dir", type=Path, default=default_cache_dir())
    parser.add_argument(
        "--refine",
        nargs="?",
        const="program",
        choices=("program", "hopper"),
        help="search knobs around the table: the program layout (the default) or the Hopper "
        "kernels",
    )
    args = parser.parse_args(argv)
    if args.refine:
        wanted = {int(r) for r in args.ranks.split(",")}
        return refine_table(args.shapes, args.zoo, wanted, args.refine)
    shapes = [(SHAPES | ZOO)[key] for key in args.shapes.split(",") if key]
    if args.zoo:
        shapes += list(ZOO.values())
    if args.model is not None:
        shapes.append(shape_from_checkpoint(args.model))
    if not shapes:
        parser.error("nothing to tune: give --model, --shapes or --zoo")
    device = torch.device("cuda")
    gpu = device_name(device)
    cache = ConfigCache(args.cache_dir)
    ranks = [int(r) for r in args.ranks.split(",")]
    buckets = [int(t) for t in args.tokens.split(",")]
    if args.fp8:
        shapes = [dataclasses.replace(shape, fp8=True) for shape in shapes]
    for shape in shapes:
        layer = _layer(shape, device)
        for rank in ranks:
            result = autotune(
                layer, rank, budget_s=args.seconds, buckets=buckets, num_slots=SLOTS,
                jobs=args.jobs,
            )  # fmt: skip
            print(
                f"{shape.label} r={rank}: {len(result.configs)} buckets in {result.seconds:.0f} s "
                f"({result.timed} timed, complete: {result.complete})",
                flush=True,
            )
            targets = [rank, 0] if rank == ranks[0] else [rank]
            for r in targets:
                if args.table:
                    store_in_table(config_path(gpu), shape, r, result.configs)
                else:
                    cache.store(gpu, shape, r, result.configs)
        del layer
        torch.cuda.empty_cache()
    where = config_path(gpu) if args.table else cache.directory
    print(f"written to {where}")
    return 0


def _layer(shape: LayerShape, device: torch.device) -> MoELayerWeights:
    """A random layer of ``shape`` (its experts FP8 where the shape says so)."""
    layer = random_layer(shape.experts, shape.hidden, shape.inter, shape.top_k, device=device)
    return fp8_layer(layer) if shape.fp8 else layer


def refine_table(names: str, zoo: bool, ranks: set[int], knobs: str) -> int:
    """``--refine``: the (shape, rank) rows of this GPU's table of ``ranks`` (and of the
    shapes named, if any), ``knobs`` searched (``kernels.autotune.refine``)."""
    device = torch.device("cuda")
    gpu = device_name(device)
    wanted = {(SHAPES | ZOO)[key] for key in names.split(",") if key}
    if zoo:
        wanted |= set(ZOO.values())
    table = load_table(gpu)
    for key, configs in table.items():
        shape, rank = parse_table_key(key)
        if rank not in ranks or (wanted and not any(shape.key == w.key for w in wanted)):
            continue
        layer = _layer(shape, device)
        store_in_table(
            config_path(gpu),
            shape,
            rank,
            refine(layer, rank, configs, num_slots=SLOTS, knobs=knobs),
        )
        del layer
        torch.cuda.empty_cache()
    print(f"written to {config_path(gpu)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
