#!/usr/bin/env python3
"""Prints the pinned requirements of the project and of one extra, one per line.

    pyproject_requirements.py registry > requirements.txt

The images install these in a layer of their own before the source is copied, so
a source change rebuilds only the small layer that installs the package itself.
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from collections.abc import Sequence
from pathlib import Path


def requirements(pyproject: Path, extra: str) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    extras: dict[str, list[str]] = project.get("optional-dependencies", {})
    if extra not in extras:
        raise KeyError(f"pyproject has no extra {extra!r}; it has {sorted(extras)}")
    return [*project["dependencies"], *extras[extra]]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("extra", help="optional-dependencies group, e.g. registry or executor")
    parser.add_argument("--pyproject", type=Path, default=Path("pyproject.toml"))
    args = parser.parse_args(argv)
    try:
        lines = requirements(args.pyproject, args.extra)
    except KeyError as exc:
        print(f"pyproject_requirements: {exc.args[0]}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
