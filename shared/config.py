"""Settings with command-line flags and ``MOELORA_*`` environment twins.

Each service declares a ``ServiceSettings`` subclass; every field becomes a flag
(``num_slots`` -> ``--num-slots``) and an environment variable (``MOELORA_NUM_SLOTS``).
Precedence: flag, then environment, then the embedded default.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal, Self, TypeVar

from pydantic import Field, ValidationError, model_validator
from pydantic_settings import BaseSettings, CliApp, SettingsConfigDict, SettingsError

from shared.call_limits import CallLimits
from shared.grpc_server import ServerOptions

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
