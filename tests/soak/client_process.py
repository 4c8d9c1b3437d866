"""One soak client: a process of its own (the GIL of one is not shared with the others) making
Forward calls with random mixes of adapters and checking every output against the reference."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

import torch

from moelora.client.errors import MoeLoraError
from moelora.client.executor import ExecutorClient, RetryPolicy
from tests.executor.worlds import World

ATOL, RTOL = 1e-5, 1e-4


@dataclass(frozen=True)
class Plan:
    """What a client calls: ``refs`` it may pick (``name``, ``name@ALIAS``); ``folders`` maps
    a resolved ``name:VERSION`` to the world's adapter folder holding its weights (versions of
    ``moving`` not listed: odd versions are ``moving_odd``, even ``moving_even``)."""

    address: str
    world: World
    refs: tuple[str, ...]
    folders: dict[str, str]
    moving: str
    moving_odd: str
    moving_even: str
    calls: int
    seed: int


@dataclass
class Outcome:
    statuses: dict[str, int] = field(default_factory=dict)
    wrong: int = 0
    latencies_ms: list[float] = field(default_factory=list)
    not_found_refs: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def _folder(plan: Plan, label: str) -> str:
    if label in plan.folders:
        return plan.folders[label]
    name, _, version = label.partition(":")
    assert name == plan.moving, label
    return plan.moving_odd if int(version) % 2 else plan.moving_even


def run(plan: Plan) -> Outcome:
    rng = random.Random(plan.seed)
    outcome = Outcome()
    world = plan.world
    with ExecutorClient(plan.address, timeout=60, retry=RetryPolicy(attempts=6)) as client:
        for _ in range(plan.calls):
            layer = rng.choice(world.moe_layers)
            sizes = [rng.randint(1, 4) for _ in range(rng.randint(1, 3))]
            refs: list[str | None] = [rng.choice([*plan.refs, None]) for _ in sizes]
            segments = list(zip(sizes, refs, strict=True))
            hidden = world.inputs[layer][: sum(sizes)]
            start = time.perf_counter()
            try:
                result = client.forward(layer, hidden, segments)
            except MoeLoraError as exc:
                outcome.statuses[exc.code.name] = outcome.statuses.get(exc.code.name, 0) + 1
                if exc.code.name == "NOT_FOUND":
                    outcome.not_found_refs.append(exc.message[:200])
                else:
                    outcome.errors.append(f"{exc.code.name}: {exc.message[:200]}")
                continue
            outcome.latencies_ms.append((time.perf_counter() - start) * 1000)
            outcome.statuses["OK"] = outcome.statuses.get("OK", 0) + 1
            names = [_folder(plan, label) if label else None for label in result.resolved_adapters]
            expected = world.expected(layer, list(zip(sizes, names, strict=True)))
            if not torch.allclose(result.output.float(), expected.float(), atol=ATOL, rtol=RTOL):
                outcome.wrong += 1
    return outcome
