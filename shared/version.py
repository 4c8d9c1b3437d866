"""The running moe-lora-serve version, as GetExecutorInfo and logs report it."""

from __future__ import annotations

from importlib import metadata


def package_version() -> str:
    """The installed distribution's version; ``0+source`` when running from a source tree
    that was not pip-installed (as on a GPU node that only has the checkout on its path)."""
    try:
        return metadata.version("moe-lora-serve")
    except metadata.PackageNotFoundError:
        return "0+source"
