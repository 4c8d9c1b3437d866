"""Adapter names and references."""

from __future__ import annotations

import pytest

from moelora.client.errors import InvalidArgument
from shared.refs import AdapterRef, validate_alias, validate_name

DIGEST = "sha256:" + "ab" * 32


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("sql-lora", AdapterRef("sql-lora")),
        ("sql-lora:3", AdapterRef("sql-lora", version=3)),
        ("sql.lora_v2@prod", AdapterRef("sql.lora_v2", alias="prod")),
        (f"a@{DIGEST}", AdapterRef("a", digest=DIGEST)),
    ],
)
def test_parse_and_format_round_trip(text: str, expected: AdapterRef) -> None:
    ref = AdapterRef.parse(text)
    assert ref == expected
    assert str(ref) == text


@pytest.mark.parametrize(
    "text",
    [
        "",
        "../etc",
        "a/b",
        "a\nb",
        "a\x00",
        ".hidden",
        "-x",
        "a..b",
        "x:0",
        "x:-1",
        "x:1.5",
        "x@",
        "x@1",
        "x@sha256:abc",
        "x" * 129,
        "ünï",
    ],
)
def test_bad_references_are_refused_naming_the_field(text: str) -> None:
    with pytest.raises(InvalidArgument, match=r"^adapter: "):
        AdapterRef.parse(text, field="adapter")


def test_names_and_aliases() -> None:
    assert validate_name("Qwen3-30B-A3B") == "Qwen3-30B-A3B"
    assert validate_alias("prod") == "prod"
    for bad in ["1st", "sha256", "a/b", "a b"]:
        with pytest.raises(InvalidArgument):
            validate_alias(bad)


def test_pinned_versions() -> None:
    assert AdapterRef.parse("a:1").is_pinned_version
    assert AdapterRef.parse(f"a@{DIGEST}").is_pinned_version
    assert not AdapterRef.parse("a@prod").is_pinned_version
    assert not AdapterRef.parse("a").is_pinned_version
