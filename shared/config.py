"""Settings with command-line flags and ``MOELORA_*`` environment twins.

Each service declares a ``ServiceSettings`` subclass; every field becomes a flag
(``num_slots`` -> ``--num-slots``) and an environment variable with the service's prefix
(``MOELORA_EXECUTOR_NUM_SLOTS``). Precedence: flag, then environment, then the embedded
default. The names without a service prefix (``MOELORA_NUM_SLOTS``) still work, below the new
ones, with a deprecation warning.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal, Self, TypeVar

from pydantic import Field, ValidationError, model_validator
from pydantic_settings import (
    BaseSettings,
    CliApp,
    CliSettingsSource,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

from shared.call_limits import CallLimits
from shared.grpc_server import ServerOptions

#: What every setting's environment variable was named before each service had a prefix of
#: its own; still read, with a deprecation warning, below the new names.
LEGACY_ENV_PREFIX = "MOELORA_"

S = TypeVar("S", bound="ServiceSettings")
_ENV_NOTE = re.compile(r" \[env: [A-Z0-9_]+\]$")


class ServiceSettings(BaseSettings):
    """Base of each service's settings. A service sets ``env_prefix`` in its model_config
    (``MOELORA_REGISTRY_``, ``MOELORA_EXECUTOR_``), so that one environment can configure
    both processes (and adapterctl) without a variable meaning two things."""

    model_config = SettingsConfigDict(
        env_prefix=LEGACY_ENV_PREFIX,
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
        for name, env in cls.env_names().items():
            field = cls.model_fields[name]
            if field.description and not field.description.endswith(f"[env: {env}]"):
                field.description = f"{_ENV_NOTE.sub('', field.description)} [env: {env}]"
                changed = True
        if changed:
            cls.model_rebuild(force=True)

    @classmethod
    def env_prefix(cls) -> str:
        return str(cls.model_config.get("env_prefix", LEGACY_ENV_PREFIX))

    @classmethod
    def env_names(cls) -> dict[str, str]:
        """Field name -> environment variable, for docs and the Helm chart."""
        return {name: f"{cls.env_prefix()}{name.upper()}" for name in cls.model_fields}

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        legacy = _LegacyEnvSource(settings_cls)
        return init_settings, env_settings, legacy, dotenv_settings, file_secret_settings


class _LegacyEnvSource(EnvSettingsSource):
    """``MOELORA_<SETTING>``, the names from before the per-service prefixes: read below the
    new names, each with a deprecation warning on stderr (logging is not set up yet)."""

    def __init__(self, settings_cls: type[BaseSettings]) -> None:
        super().__init__(settings_cls, env_prefix=LEGACY_ENV_PREFIX)
        self._settings_cls = settings_cls

    def __call__(self) -> dict[str, Any]:
        found = super().__call__()
        cls = self._settings_cls
        assert issubclass(cls, ServiceSettings)
        if cls.env_prefix() == LEGACY_ENV_PREFIX:
            return found
        for name in found:
            old, new = f"{LEGACY_ENV_PREFIX}{name.upper()}", cls.env_names()[name]
            effect = f"ignored, {new} is set" if new in os.environ else f"rename it {new}"
            print(f"{cls.prog_name}: {old} is deprecated ({effect})", file=sys.stderr)
        return found


class ServerSettings(ServiceSettings):
    """What every gRPC server of the project is configured with. Each service declares
    ``listen``, ``metrics_listen`` and ``max_message_bytes`` again with defaults of its own."""

    listen: str = Field(description="host:port the gRPC server listens on")
    metrics_listen: str = Field(
        description="host:port of the Prometheus /metrics endpoint; empty: off"
    )
    max_message_bytes: int = Field(ge=4 * 1024 * 1024, description="largest gRPC message in bytes")
    drain_seconds: float = Field(
        30.0, ge=0, description="on SIGTERM, how long RPCs in flight may finish"
    )
    tls_cert_file: Path | None = Field(None, description="PEM certificate: serve TLS")
    tls_key_file: Path | None = Field(None, description="PEM private key for tls_cert_file")
    max_concurrent_rpcs: int = Field(
        0,
        ge=0,
        description="calls in progress at once (running or waiting for a worker thread), "
        "health, reflection and the registry's watches apart; more are refused at once with "
        "RESOURCE_EXHAUSTED and a retry hint; 0 = four per worker thread",
    )
    max_calls_per_peer: int = Field(
        64,
        ge=1,
        description="calls without a bearer token (every call while auth is off) that one "
        "client address may have in progress at once; more: RESOURCE_EXHAUSTED",
    )
    message_timeout_seconds: float = Field(
        5.0,
        gt=0,
        description="how long a call's request message (a request stream's first one) may "
        "take to arrive; a call still waiting then ends with DEADLINE_EXCEEDED and frees its "
        "thread",
    )
    log_level: str = Field("info", description="debug, info, warning or error")
    log_format: Literal["json", "text"] = Field("json", description="json or text log lines")

    @model_validator(mode="after")
    def _tls_pair(self) -> Self:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("tls_cert_file and tls_key_file go together: set both or neither")
        return self

    def server_options(self, max_workers: int = 16) -> ServerOptions:
        return ServerOptions(
            listen=self.listen,
            max_message_bytes=self.max_message_bytes,
            max_workers=max_workers,
            drain_seconds=self.drain_seconds,
            tls_cert_file=self.tls_cert_file,
            tls_key_file=self.tls_key_file,
            limits=CallLimits(
                max_concurrent_rpcs=self.max_concurrent_rpcs,
                max_calls_per_peer=self.max_calls_per_peer,
                message_timeout_seconds=self.message_timeout_seconds,
            ),
        )


def settings_reference(cls: type[ServiceSettings]) -> str:
    """A Markdown table of every setting of ``cls``: flag, environment variable, default and
    meaning (docs/configuration.md is made of these)."""
    rows = ["| flag | environment | default | meaning |", "| --- | --- | --- | --- |"]
    for name, field in cls.model_fields.items():
        default = "" if field.is_required() else field.get_default(call_default_factory=True)
        shown = "(none)" if default is None or default == [] else f"`{default}`"
        meaning = (field.description or "").split(" [env: ")[0].replace("|", "\\|")
        flag = "--" + name.replace("_", "-")
        env = cls.env_names()[name]
        rows.append(f"| `{flag}` | `{env}` | {shown} | {meaning} |")
    return "\n".join(rows) + "\n"


def parse_settings(
    cls: type[S],
    argv: Sequence[str] | None = None,
    *,
    prog: str | None = None,
    description: str | None = None,
) -> S:
    """Parses flags (and the environment) into ``cls``; exits with status 2 and one
    readable line per problem when a value is invalid. ``prog`` and ``description`` head
    ``--help`` (default: the program's name and the settings class's doc)."""
    args = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog=prog or cls.prog_name,
        description=description or cls.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source: CliSettingsSource[S] = CliSettingsSource(
        cls, root_parser=parser, cli_hide_none_type=True
    )
    try:
        return CliApp.run(cls, cli_args=args, cli_settings_source=source)
    except (ValidationError, SettingsError) as exc:
        print(f"{cls.prog_name}: invalid configuration: {_describe(cls, exc)}", file=sys.stderr)
        raise SystemExit(2) from None


def _describe(cls: type[ServiceSettings], exc: ValidationError | SettingsError) -> str:
    if isinstance(exc, ValidationError):
        parts = []
        for err in exc.errors():
            field = ".".join(str(p) for p in err["loc"])
            env = f"{cls.env_prefix()}{field.upper()}"
            parts.append(f"--{field.replace('_', '-')} / {env}: {err['msg']}")
        return "; ".join(parts)
    return str(exc)
