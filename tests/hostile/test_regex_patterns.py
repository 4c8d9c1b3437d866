"""rank_pattern / alpha_pattern regexes that backtrack exponentially in Python's re (a write
token is all an uploader needs): the upload is checked at once, registry health answers
throughout, and an executor that loads the adapter keeps answering base-model Forwards."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

from tests.executor.conftest import assert_close
from tests.hostile.conftest import HealthWatch
from tests.live_stack import BASE, Stack

#: Python's re takes ~2^n steps for these on a module key (n = 24: 11 s; 40: days).
PATTERNS = {"(.|.){40}Z": 4, ".{0,40}" * 30 + "Z": 4}


def test_backtracking_patterns_cost_nothing(authed_stack: Stack, tmp_path: Path) -> None:
    world = authed_stack.world
    adapter = tmp_path / "regex"
    shutil.copytree(world.adapter_dir / "alpha", adapter)
    config = json.loads((adapter / "adapter_config.json").read_text())
    config["rank_pattern"] = {**config.get("rank_pattern", {}), **PATTERNS}
    config["alpha_pattern"] = {**config.get("alpha_pattern", {}), **PATTERNS}
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    layer = world.moe_layers[0]
    hidden = world.inputs[layer][:4]
    base_seconds: list[float] = []
    stop = threading.Event()

    def base_forwards() -> None:
        with authed_stack.executor_client() as client:
            while not stop.is_set():
                start = time.monotonic()
                client.forward(layer, hidden, [(4, None)], timeout=30)
                base_seconds.append(time.monotonic() - start)

    with (
        HealthWatch(authed_stack.registry_address) as registry_health,
        HealthWatch(authed_stack.executor_address) as executor_health,
    ):
        forwards = threading.Thread(target=base_forwards, daemon=True)
        forwards.start()
        start = time.monotonic()
        with authed_stack.registry_client() as registry:
            registry.upload(adapter, "regex", BASE)
        upload_seconds = time.monotonic() - start
        with authed_stack.executor_client() as executor:
            start = time.monotonic()
            result = executor.forward(layer, hidden, [(4, "regex")], timeout=60)
            load_seconds = time.monotonic() - start
        time.sleep(0.3)
        stop.set()
        forwards.join(30)
    print(f"\nregex patterns: upload {upload_seconds:.2f} s, first Forward (load) "
          f"{load_seconds:.2f} s, base Forward worst {max(base_seconds) * 1000:.0f} ms, "
          f"health worst {registry_health.worst * 1000:.0f} / "
          f"{executor_health.worst * 1000:.0f} ms")  # fmt: skip
    # The patterns match no module: the adapter computes exactly what alpha does.
    assert_close(result.output, world.expected(layer, [(4, "alpha")]))
    assert upload_seconds < 5
    assert max(base_seconds) < 2
    registry_health.check()
    executor_health.check()
