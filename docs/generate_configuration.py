"""Writes docs/configuration.md from the services' settings classes (``make docs``); a test
fails when the committed file is out of date."""

from __future__ import annotations

import sys
from pathlib import Path

from executor_service.config import ExecutorSettings
from registry_service.config import RegistrySettings
from shared.config import settings_reference

PATH = Path(__file__).with_name("configuration.md")

HEADER = """# Configuration reference

Generated from the settings classes by `make docs`; do not edit by hand.

Every setting is a command-line flag with an environment twin named with its service's prefix:
`--num-slots 16` or `MOELORA_EXECUTOR_NUM_SLOTS=16`, `--listen` or `MOELORA_REGISTRY_LISTEN`.
A flag wins over the environment, which wins over the default. Values that are lists (such as
`--preload-adapters`) take JSON in the environment
(`MOELORA_EXECUTOR_PRELOAD_ADAPTERS='["sql@prod"]'`). An invalid value stops the program with
exit status 2 and one line naming the flag and its variable. The names from before the
prefixes (`MOELORA_NUM_SLOTS`) are still read, below the new ones, each with a deprecation
warning on stderr.

`adapterctl` reads `MOELORA_REGISTRY_ADDRESS`, `MOELORA_REGISTRY_TOKEN`, `MOELORA_REGISTRY_TLS`
and `MOELORA_REGISTRY_CA_FILE` (see `adapterctl --help` and docs/registry.md). The executor has
its own (`MOELORA_EXECUTOR_REGISTRY_ADDRESS`, `_TOKEN`, `_TLS`); while the names from before the
prefixes are still read, an executor without them falls back to adapterctl's
`MOELORA_REGISTRY_ADDRESS`, `_TOKEN` and `_TLS` (with the deprecation warning), so set the
executor's own wherever both run in one environment.
"""


def render() -> str:
    return (
        f"{HEADER}\n## `moelora-registry` (registry_service/config.py)\n\n"
        f"{settings_reference(RegistrySettings)}\n"
        f"## `moelora-executor` (executor_service/config.py)\n\n"
        f"{settings_reference(ExecutorSettings)}"
    )


if __name__ == "__main__":
    PATH.write_text(render())
    sys.stdout.write(f"wrote {PATH}\n")
