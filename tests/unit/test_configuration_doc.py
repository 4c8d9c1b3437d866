"""docs/configuration.md is what the settings classes say (regenerate with `make docs`)."""

from __future__ import annotations

from docs.generate_configuration import PATH, render


def test_configuration_reference_is_up_to_date() -> None:
    assert PATH.read_text() == render(), "docs/configuration.md is stale: run `make docs`"
