"""Layer sets: "0-23,30,40-47" parses to layers and formats back."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from executor_service.config import ExecutorSettings
from moelora.client.errors import InvalidArgument
from moelora.client.layer_set import format_layers, parse_layers


@pytest.mark.parametrize(
    ("text", "layers", "canonical"),
    [
        ("0-3,7", (0, 1, 2, 3, 7), "0-3,7"),
        ("5", (5,), "5"),
        (" 9, 0-1 ,1-2", (0, 1, 2, 9), "0-2,9"),
        ("0-23,30,40-47", (*range(24), 30, *range(40, 48)), "0-23,30,40-47"),
    ],
)
def test_round_trip(text: str, layers: tuple[int, ...], canonical: str) -> None:
    assert parse_layers(text) == layers
    assert format_layers(layers) == canonical
    assert parse_layers(canonical) == layers


@pytest.mark.parametrize("text", ["", "1,,2", "3-1", "-2", "a-b", "1-2-3", "x"])
def test_rejects(text: str) -> None:
    with pytest.raises(InvalidArgument, match="layers"):
        parse_layers(text)


def test_setting_is_checked() -> None:
    assert ExecutorSettings.model_validate({"layers": "0-2,4"}).layer_set == (0, 1, 2, 4)
    assert ExecutorSettings.model_validate({}).layer_set is None
    with pytest.raises(ValidationError, match="--layers"):
        ExecutorSettings.model_validate({"layers": "4-1"})
