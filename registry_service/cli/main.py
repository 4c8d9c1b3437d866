"""``adapterctl`` entry point."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> None:
    print("adapterctl: no commands in this build yet", file=sys.stderr)
    raise SystemExit(2)
