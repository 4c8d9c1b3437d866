"""Both services as real processes with auth on, attacked as a client without (or with a low)
token would: what each attack gets, and that health answers within a second throughout. Short
in ``make test``; ``make fuzz`` (``--long``) attacks longer and harder and prints the figures."""

from __future__ import annotations

import json
import multiprocessing
import queue
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from shared.tokens import Role, new_token_entry
from tests.executor.worlds import Recipe, World, build_world
from tests.hostile.probe import HEALTH_BOUND_SECONDS, probe
from tests.live_stack import Stack
from tests.proxy import CuttingProxy

#: The address attackers' connections come from (the probes' come from 127.0.0.1).
ATTACKER_ADDRESS = "127.0.0.2"
#: The servers' --message-timeout-seconds (shorter than the default: shorter tests).
MESSAGE_TIMEOUT_SECONDS = 2.0


@dataclass
class Tokens:
    path: Path
    #: role name ("read", "write", "admin") -> token
    plain: dict[str, str]
    entries: list[dict[str, Any]]

    def revoke(self, role: str) -> None:
        """Removes the token of ``role`` from the file (the servers re-read it)."""
        kept = [e for e in self.entries if e["name"] != role]
        self.path.write_text(json.dumps({"tokens": kept}))

    def restore(self) -> None:
        self.path.write_text(json.dumps({"tokens": self.entries}))


@pytest.fixture(scope="session")
def hostile_tokens(tmp_path_factory: pytest.TempPathFactory) -> Tokens:
    plain, entries = {}, []
    for role in Role:
        # The read token is the executors': the fleet's.
        token, entry = new_token_entry(role.name.lower(), role, fleet=role is Role.READ)
        plain[role.name.lower()] = token
        entries.append(entry)
    # A second read token: one tenant's, revoked in tests while the executors' stays.
    token, entry = new_token_entry("tenant", Role.READ)
    plain["tenant"] = token
    entries.append(entry)
    path = tmp_path_factory.mktemp("tokens") / "tokens.json"
    tokens = Tokens(path, plain, entries)
    tokens.restore()
    return tokens


@pytest.fixture(scope="session")
def hostile_world(tmp_path_factory: pytest.TempPathFactory) -> World:
    return build_world(
        "qwen3_moe", tmp_path_factory.mktemp("hostile") / "world", [Recipe("alpha", "both", 1)]
    )


@pytest.fixture(scope="session")
def authed_stack(
    hostile_world: World, hostile_tokens: Tokens, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    """A registry and an executor with auth on (the test's own clients hold the admin token;
    the executor pulls with the read token)."""
    auth = (
        "--auth", "on", "--auth-tokens-file", str(hostile_tokens.path),
        "--message-timeout-seconds", str(MESSAGE_TIMEOUT_SECONDS),
    )  # fmt: skip
    stack = Stack(
        hostile_world,
        tmp_path_factory.mktemp("authed"),
        registry_flags=auth,
        executor_flags=(*auth, "--registry-token", hostile_tokens.plain["read"]),
        token=hostile_tokens.plain["admin"],
    )
    try:
        stack.start(["alpha"])
        yield stack
    finally:
        stack.stop()


@pytest.fixture
def attacker(authed_stack: Stack) -> Iterator[dict[str, str]]:
    """Service name -> an address that reaches it from ``ATTACKER_ADDRESS``."""
    proxies = {
        "registry": CuttingProxy(authed_stack.registry_address, source=ATTACKER_ADDRESS),
        "executor": CuttingProxy(authed_stack.executor_address, source=ATTACKER_ADDRESS),
    }
    try:
        yield {name: proxy.address for name, proxy in proxies.items()}
    finally:
        for proxy in proxies.values():
            proxy.close()


@dataclass
class HealthWatch:
    """Checks health of ``address`` every ``interval`` seconds, each on a fresh connection (as
    a kubelet probe does), until stopped; records how long each answer took. The probes run
    in a process of their own, as a kubelet's do: the attack's client threads in this process
    would otherwise hold the GIL that the probe's own call needs, and time the test, not the
    service. The first probe has answered when the block begins, and one more runs when it
    ends."""

    address: str
    interval: float = 0.1
    seconds: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    _stop: Any = None
    _answers: Any = None
    _process: Any = None

    def __enter__(self) -> HealthWatch:
        context = multiprocessing.get_context("spawn")
        self._stop, self._answers = context.Event(), context.Queue()
        self._process = context.Process(
            target=probe, args=(self.address, self.interval, self._stop, self._answers)
        )
        self._process.start()
        self._record(self._answers.get(timeout=60))
        return self

    def _record(self, answer: tuple[float, str]) -> None:
        seconds, failure = answer
        self.seconds.append(seconds)
        if failure:
            self.failures.append(failure)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._process.join(10)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        while True:
            try:
                self._record(self._answers.get(timeout=0.5))
            except queue.Empty:
                break
        self._answers.close()

    @property
    def worst(self) -> float:
        return max(self.seconds, default=float("inf"))

    def check(self) -> None:
        """Every probe answered SERVING within the bound."""
        assert len(self.seconds) > 1, "no health probe ran after the attack began"
        assert not self.failures, f"health probes failed: {self.failures[:5]}"
        assert self.worst < HEALTH_BOUND_SECONDS, f"slowest health answer {self.worst:.2f} s"


def long_run(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--long"))
