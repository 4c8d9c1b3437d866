"""Settings with command-line flags and ``MOELORA_*`` environment twins.

Each service declares a ``ServiceSettings`` subclass; every field becomes a flag
(``num_slots`` -> ``--num-slots``) and an environment variable (``MOELORA_NUM_SLOTS``).
Precedence: flag, then environment, then the embedded default.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, ClassVar, TypeVar

from pydantic import ValidationError
from pydantic_settings import BaseSettings, CliApp, SettingsConfigDict, SettingsError

ENV_PREFIX = "MOELORA_"

S = TypeVar("S", bound="ServiceSettings")


class ServiceSettings(BaseSettings):
    """Base of each service's settings."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        cli_kebab_case=True,
        cli_implicit_flags=True,
        extra="ignore",
        frozen=True,
    )
    prog_name: ClassVar[str] = "moelora"

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        # Say each flag's environment twin in --help, so operators see both names.
        changed = False
        for name, field in cls.model_fields.items():
            env = f"{ENV_PREFIX}{name.upper()}"
            if field.description and env not in field.description:
                field.description = f"{field.description} [env: {env}]"
                changed = True
        if changed:
            cls.model_rebuild(force=True)

    @classmethod
    def env_names(cls) -> dict[str, str]:
        """Field name -> environment variable, for docs and the Helm chart."""
        return {name: f"{ENV_PREFIX}{name.upper()}" for name in cls.model_fields}


def settings_reference(cls: type[ServiceSettings]) -> str:
    """A Markdown table of every setting of ``cls``: flag, environment variable, default and
    meaning (docs/configuration.md is made of these)."""
    rows = ["| flag | environment | default | meaning |", "| --- | --- | --- | --- |"]
    for name, field in cls.model_fields.items():
        default = "" if field.is_required() else field.get_default(call_default_factory=True)
        shown = "(none)" if default is None or default == [] else f"`{default}`"
        meaning = (field.description or "").split(" [env: ")[0].replace("|", "\\|")
        flag = "--" + name.replace("_", "-")
        rows.append(f"| `{flag}` | `{ENV_PREFIX}{name.upper()}` | {shown} | {meaning} |")
    return "\n".join(rows) + "\n"


def parse_settings(cls: type[S], argv: Sequence[str] | None = None) -> S:
    """Parses flags (and the environment) into ``cls``; exits with status 2 and one
    readable line per problem when a value is invalid."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        return CliApp.run(cls, cli_args=args, cli_settings_source=None)
    except (ValidationError, SettingsError) as exc:
        print(f"{cls.prog_name}: invalid configuration: {_describe(exc)}", file=sys.stderr)
        raise SystemExit(2) from None


def _describe(exc: ValidationError | SettingsError) -> str:
    if isinstance(exc, ValidationError):
        parts = []
        for err in exc.errors():
            field = ".".join(str(p) for p in err["loc"])
            parts.append(f"--{field.replace('_', '-')} / {ENV_PREFIX}{field.upper()}: {err['msg']}")
        return "; ".join(parts)
    return str(exc)
