"""The stress run: many concurrent clients, every answer checked
(``python -m executor_service.bench.forward --stress SECONDS``).

Concurrency bugs hide from sequential tests, so this drives the executor the way a busy
attention tier does and checks every single answer:

* the executor runs as its own process, CUDA graphs as configured (on by default on a GPU);
  its base model has two MoE layers;
* a pool of requests, each with a random T (half of them at a graph bucket's edge: b - 1, b,
  b + 1), one to four segments, each segment the base model or an adapter: a pinned "hot" one,
  or one of the "cold" ones, more than the free slots hold, so that batches churn slots while
  graphs replay;
* each pool request's answer is computed first, alone and eagerly, by the executor's own
  engine in this process (``reference.EagerReference``);
* ``clients`` processes, released together once each has started (imports, pool, CUDA context: a
  real service's clients start elsewhere), each on its own connection, send random pool requests
  for ``seconds`` and compare every answer row by row (``answers.worst_row_error`` against
  ``answers.row_tolerance``). They take the ``modes`` in turn: bytes in unary ``Forward`` and in
  ``ForwardStream``, a shared-memory ring, CUDA tensors through the client's own device path,
  asyncio direct channels with calls overlapping and leases churning, blocking channels through
  their spin blocks, and network channels (``stress_client.MODES``).

It fails on any status other than OK (RESOURCE_EXHAUSTED, a busy executor's answer, is allowed
up to ``MAX_EXHAUSTED_SHARE`` of the calls), on any mismatch, on a broken stream, and if the
executor died, stopped reporting SERVING, or did not exit cleanly on SIGTERM. The report counts
requests, merged batch sizes, graph buckets hit and slot loads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import json
import math
import random
import select
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import torch
from prometheus_client.parser import text_string_to_metric_families

from executor_service.bench.answers import bf16_bytes, row_tolerance
from executor_service.bench.processes import progress
from executor_service.bench.reference import EagerReference
from executor_service.bench.shapes import SHAPES
from executor_service.bench.stats import percentile
from executor_service.bench.stress_client import MODES, PoolRequest, write_pool
from executor_service.graphs import BUCKETS
from executor_service.synthetic import SyntheticAdapter, write_adapter, write_base_checkpoint
from moelora.client.executor import ExecutorClient
from moelora.client.health import health_check
from shared.ports import free_port

#: RESOURCE_EXHAUSTED answers allowed, as a share of all calls.
MAX_EXHAUSTED_SHARE = 0.05
#: Ranks of the adapters, in turn (every adapter at most the executor's max rank).
RANKS = (16, 8, 4)


@dataclass(frozen=True)
class StressSettings:
    seconds: float
    device: str = "cuda"
    shape: str = "qwen3-30b-a3b"
    layers: int = 2
    clients: int = 32
    #: Distinct requests the clients draw from.
    pool: int = 64
    #: Adapters in all; the first ``pinned`` are pinned, the rest churn through the other slots.
    adapters: int = 16
    pinned: int = 4
    slots: int = 8
    max_rank: int = 16
    max_tokens: int = 512
    cuda_graphs: str = "auto"
    seed: int = 0
    #: The clients' modes, taken in turn (``stress_client.MODES``); None: every mode the
    #: device can run (``device`` needs a GPU).
    modes: tuple[str, ...] | None = None
    #: How long the clients may take to start (imports, pool, CUDA context) before the run
    #: fails rather than waits.
    client_start_seconds: float = 300.0

    def client_modes(self) -> tuple[str, ...]:
        if self.modes is not None:
            return self.modes
        on_cpu = self.device == "cpu"
        # NCCL needs a GPU of the client's own beside the executor's.
        two_gpus = torch.cuda.is_available() and torch.cuda.device_count() > 1
        return tuple(
            m
            for m in MODES
            if not (m == "device" and on_cpu)
            and not (m == "network" and not on_cpu and not two_gpus)
        )

    def network_device(self) -> str:
        """Where network clients keep their tensors: the CPU for a CPU executor (Gloo), else
        the last GPU (NCCL)."""
        if self.device == "cpu":
            return "cpu"
        return f"cuda:{torch.cuda.device_count() - 1}"


@dataclass(frozen=True)
class Answer:
    """One answered call: how long it took, its client's mode, its T, and when it began
    (seconds after the clients were released)."""

    seconds: float
    mode: str
    tokens: int
    began_s: float


#: The slowest answers the report names.
SLOWEST = 5


@dataclass(frozen=True)
class HostLoads:
    """Adapters the executor brought into host memory (fetched, verified, packed) during the
    run: a request for an adapter not yet there waits for its load, so slow loads show as a
    start-up tail."""

    count: int
    seconds: float
    #: The latency histogram's bound that the slowest load fell under (inf: beyond the last).
    slowest_within: float

    @property
    def mean(self) -> float:
        return self.seconds / self.count if self.count else 0.0


@dataclass
class StressReport:
    settings: StressSettings
    device_name: str = ""
    tolerance: float = 0.0
    codes: Counter[str] = field(default_factory=Counter)
    by_mode: Counter[str] = field(default_factory=Counter)
    mismatched: int = 0
    mismatches: list[dict[str, object]] = field(default_factory=list)
    worst_row_error: float = 0.0
    #: Every answer's timing, from which the latency figures are drawn.
    answers: list[Answer] = field(default_factory=list)
    #: Requests the executor counted by transport (its metric's label -> count).
    by_transport: dict[str, int] = field(default_factory=dict)
    #: Launches by the number of requests merged into them (histogram's upper bound -> count).
    batch_sizes: dict[str, int] = field(default_factory=dict)
    mean_batch: float = 0.0
    graph_replays: dict[int, int] = field(default_factory=dict)
    eager_launches: int = 0
    slot_loads: int = 0
    slot_evictions: int = 0
    host_loads: HostLoads = HostLoads(0, 0.0, 0.0)
    problems: list[str] = field(default_factory=list)

    @property
    def requests(self) -> int:
        return sum(self.codes.values())

    @property
    def p50_ms(self) -> float:
        return 1e3 * percentile([a.seconds for a in self.answers], 0.5) if self.answers else 0.0

    @property
    def p99_ms(self) -> float:
        return 1e3 * percentile([a.seconds for a in self.answers], 0.99) if self.answers else 0.0

    @property
    def latency_by_mode(self) -> dict[str, list[float]]:
        """Each answer's latency (s) by its client's mode."""
        split: dict[str, list[float]] = {}
        for a in self.answers:
            split.setdefault(a.mode, []).append(a.seconds)
        return split

    @property
    def latency_by_size(self) -> dict[str, list[float]]:
        """Each answer's latency (s) by its request's size band (``SIZE_BANDS``)."""
        split: dict[str, list[float]] = {}
        for a in self.answers:
            split.setdefault(_size_band(a.tokens), []).append(a.seconds)
        return split

    @property
    def slowest(self) -> list[Answer]:
        """The ``SLOWEST`` answers, slowest first: whether a tail is start-up or mid-run."""
        return heapq.nlargest(SLOWEST, self.answers, key=lambda a: a.seconds)

    def failures(self) -> list[str]:
        found = list(self.problems)
        if self.requests == 0:
            found.append("no request was answered")
        bad = {c: n for c, n in self.codes.items() if c not in ("OK", "RESOURCE_EXHAUSTED")}
        if bad:
            found.append(f"error answers: {bad}")
        exhausted = self.codes.get("RESOURCE_EXHAUSTED", 0)
        if exhausted > MAX_EXHAUSTED_SHARE * max(self.requests, 1):
            found.append(f"{exhausted} RESOURCE_EXHAUSTED of {self.requests} calls")
        if self.mismatched:
            found.append(f"{self.mismatched} answers differ from the reference: {self.mismatches}")
        unused = [t for t in self._transports() if not self.by_transport.get(t)]
        if self.requests and unused:
            found.append(f"no request came by {unused}: {self.by_transport}")
        return found

    def _transports(self) -> set[str]:
        """The executor's transport labels that the clients' modes must have used."""
        on_gpu = self.settings.device != "cpu"
        label = {
            "unary": "message",
            "stream": "message",
            "shm": "shared_memory",
            "device": "cuda_memory",
            "channel": "cuda_memory" if on_gpu else "shared_memory",
            "spin": "cuda_memory" if on_gpu else "shared_memory",
            "network": "network_channel",
        }
        return {label[m] for m in self.by_mode}

    def table(self) -> str:
        s = self.settings
        ok = self.codes.get("OK", 0)
        exhausted = self.codes.get("RESOURCE_EXHAUSTED", 0)
        other = self.requests - ok - exhausted
        by_mode, by_size = self.latency_by_mode, self.latency_by_size
        lines = [
            f"Stress, {s.seconds:.0f} s: {s.clients} client processes "
            f"({', '.join(f'{n} {m}' for m, n in self.by_mode.items())}), "
            f"{s.shape} x {s.layers} layers on {self.device_name}, graphs {s.cuda_graphs}, "
            f"{s.adapters} adapters ({s.pinned} pinned) over {s.slots} slots, pool of {s.pool} "
            f"requests (T 1-{s.max_tokens}, 1-4 segments, base rows too)",
            "",
            "| requests | OK | RESOURCE_EXHAUSTED | other errors | mismatches | worst row error "
            "(tolerance) | p50 ms | p99 ms | mean batch | eager launches | slot loads | "
            "slot evictions |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            f"| {self.requests:,} | {ok:,} | {exhausted:,} | {other:,} | {self.mismatched:,} | "
            f"{self.worst_row_error:.2e} ({self.tolerance:.0e}) | {self.p50_ms:.2f} | "
            f"{self.p99_ms:.2f} | {self.mean_batch:.2f} | {self.eager_launches:,} | "
            f"{self.slot_loads:,} | {self.slot_evictions:,} |",
            "",
            "Launches by requests merged: "
            + ", ".join(f"<={k}: {v:,}" for k, v in self.batch_sizes.items() if v),
            "Graph replays by bucket: "
            + ", ".join(f"{k}: {v:,}" for k, v in sorted(self.graph_replays.items())),
            "Requests by transport (executor's count): "
            + ", ".join(f"{k}: {v:,}" for k, v in sorted(self.by_transport.items())),
            f"Adapter loads into host memory (fetch, verify, pack): {self.host_loads.count:,}, "
            f"mean {self.host_loads.mean:.3f} s, slowest within "
            f"{self.host_loads.slowest_within:g} s",
            "",
            "| latency by | requests | p50 ms | p99 ms | max ms |",
            "|---|---:|---:|---:|---:|",
            *(
                f"| {name} | {len(times):,} | {1e3 * percentile(times, 0.5):.2f} | "
                f"{1e3 * percentile(times, 0.99):.2f} | {1e3 * max(times):.2f} |"
                for name, times in [
                    *((f"{m} clients", t) for m, t in by_mode.items()),
                    *((f"T {band}", by_size.get(band, [])) for _, band in SIZE_BANDS),
                ]
                if times
            ),
            "",
            "Slowest answers: "
            + "; ".join(
                f"{1e3 * c.seconds:.0f} ms ({c.mode}, T {c.tokens}, began {c.began_s:.1f} s "
                "after the clients were released)"
                for c in self.slowest
            ),
            "",
        ]
        failures = self.failures()
        lines.append("FAILED: " + "; ".join(failures) if failures else "PASSED")
        return "\n".join(lines)


#: Request sizes the latency table tells apart: (upper bound of T, label).
SIZE_BANDS = ((16, "1-16"), (128, "17-128"), (math.inf, "129+"))


def _size_band(tokens: int) -> str:
    return next(label for bound, label in SIZE_BANDS if tokens <= bound)


def _token_counts(rng: random.Random, count: int, limit: int) -> list[int]:
    """Half at a bucket's edge (b - 1, b, b + 1), half uniform in 1..limit."""
    edges = sorted({t for b in BUCKETS for t in (b - 1, b, b + 1) if 1 <= t <= limit})
    return [rng.choice(edges) if i % 2 else rng.randint(1, limit) for i in range(count)]


def _segments(
    rng: random.Random, tokens: int, hot: list[str], cold: list[str]
) -> list[tuple[int, str]]:
    parts = rng.randint(1, min(4, tokens))
    cuts = sorted(rng.sample(range(1, tokens), parts - 1)) if parts > 1 else []
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, tokens], strict=True)]
    segments = []
    for size in sizes:
        draw = rng.random()
        adapter = "" if draw < 0.2 else rng.choice(hot) if draw < 0.7 else rng.choice(cold)
        segments.append((size, adapter))
    return segments


def _pool(
    settings: StressSettings,
    reference: EagerReference,
    layers: list[int],
    hidden_size: int,
    hot: list[str],
    cold: list[str],
) -> list[PoolRequest]:
    rng = random.Random(settings.seed)
    values = np.random.default_rng(settings.seed)
    pool = []
    for index, tokens in enumerate(_token_counts(rng, settings.pool, settings.max_tokens)):
        layer = rng.choice(layers)
        segments = _segments(rng, tokens, hot, cold)
        floats = values.standard_normal((tokens, hidden_size), dtype=np.float32)
        hidden = np.frombuffer(bf16_bytes(floats), dtype="<u2").reshape(tokens, hidden_size)
        expected = reference.forward(layer, hidden, segments)
        pool.append(PoolRequest(index, layer, segments, hidden, expected))
    return pool


#: Scraped samples: (name, sorted labels) -> value.
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _scrape(url: str) -> Samples:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def _histogram(
    samples: Samples, name: str, labels: tuple[tuple[str, str], ...] = ()
) -> tuple[list[tuple[float, int]], int, float]:
    """The series of histogram ``name`` with ``labels``: its cumulative buckets (upper bound,
    observations up to it) in order, its count and its sum."""
    buckets = sorted(
        (float(dict(series)["le"]), int(value))
        for (sample, series), value in samples.items()
        if sample == f"{name}_bucket" and tuple(kv for kv in series if kv[0] != "le") == labels
    )
    count = int(samples.get((f"{name}_count", labels), 0))
    return buckets, count, samples.get((f"{name}_sum", labels), 0.0)


def _summarise_metrics(report: StressReport, url: str) -> None:
    samples = _scrape(url)
    buckets, count, total = _histogram(samples, "moelora_executor_batch_requests")
    previous = 0
    for bound, cumulative in buckets:
        if not math.isinf(bound):
            report.batch_sizes[f"{bound:g}"] = cumulative - previous
            previous = cumulative
    report.mean_batch = total / count if count else 0.0
    report.graph_replays = {
        int(dict(labels)["bucket"]): int(value)
        for (name, labels), value in samples.items()
        if name == "moelora_executor_graph_replays_total"
    }
    report.eager_launches = int(
        samples.get(("moelora_executor_forward_runs_total", (("mode", "eager"),)), 0)
    )
    report.slot_loads = int(
        samples.get(("moelora_executor_adapter_misses_total", (("tier", "gpu"),)), 0)
    )
    report.by_transport = {
        dict(labels)["transport"]: int(value)
        for (name, labels), value in samples.items()
        if name == "moelora_executor_forward_requests_by_transport_total"
    }
    report.slot_evictions = int(
        samples.get(("moelora_executor_adapter_evictions_total", (("tier", "gpu"),)), 0)
    )
    report.host_loads = host_loads(samples)


def host_loads(samples: Samples) -> HostLoads:
    """The host tier's adapter loads from the executor's load-time histogram."""
    buckets, count, seconds = _histogram(
        samples, "moelora_executor_adapter_load_seconds", (("tier", "host"),)
    )
    slowest = next((bound for bound, cumulative in buckets if cumulative >= count), 0.0)
    return HostLoads(count, seconds, slowest if count else 0.0)


def _progress(message: str) -> None:
    progress("stress", message)


def run(settings: StressSettings, workdir: Path | None = None) -> StressReport:
    """Runs the stress and returns its report (``report.failures()`` empty when it passed)."""
    report = StressReport(settings, tolerance=row_tolerance(settings.device))
    with tempfile.TemporaryDirectory(prefix="stress-", dir=workdir) as tmp:
        root = Path(tmp)
        base = dataclasses.replace(SHAPES[settings.shape], num_layers=settings.layers)
        dtype = torch.float32 if settings.device == "cpu" else torch.bfloat16
        spec = write_base_checkpoint(root / "base", base, dtype=dtype)
        names = [f"stress-{i}" for i in range(settings.adapters)]
        for i, name in enumerate(names):
            rank = RANKS[i % len(RANKS)]
            write_adapter(root / "adapters" / name, spec, SyntheticAdapter(rank=rank), seed=i)
        hot, cold = names[: settings.pinned], names[settings.pinned :]
        _progress(f"computing {settings.pool} reference answers alone, eagerly")
        reference = EagerReference(
            root / "base", root / "adapters", settings.device, settings.max_rank, root / "ref-cache"
        )
        try:
            pool = _pool(settings, reference, list(spec.moe_layers), spec.hidden_size, hot, cold)
        finally:
            reference.close()
            del reference
        write_pool(root / "pool", pool)
        del pool
        if settings.device != "cpu":
            torch.cuda.empty_cache()
        port, metrics_port = free_port(), free_port()
        address = f"127.0.0.1:{port}"
        log_path = root / "executor.log"
        command = [
            sys.executable, "-m", "executor_service.main",
            f"--listen={address}", f"--metrics-listen=127.0.0.1:{metrics_port}",
            f"--base-model-path={root / 'base'}", f"--adapter-dir={root / 'adapters'}",
            "--registry-address=", f"--disk-cache-dir={root / 'cache'}",
            f"--device={settings.device}", f"--num-slots={settings.slots}",
            f"--max-rank={settings.max_rank}", f"--cuda-graphs={settings.cuda_graphs}",
            "--kernel-autotune-seconds=0", "--log-format=json",
            "--network-channel-port=0", "--network-channel-host=127.0.0.1",
        ]  # fmt: skip
        with log_path.open("w") as log_file:
            executor = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT)
        try:
            _drive(settings, report, executor, address, root / "pool", metrics_port)
        finally:
            if executor.poll() is None:
                executor.send_signal(signal.SIGTERM)
                try:
                    status = executor.wait(60)
                except subprocess.TimeoutExpired:
                    executor.kill()
                    status = executor.wait()
                    report.problems.append("the executor did not stop within 60 s of SIGTERM")
                if status != 0:
                    report.problems.append(f"the executor exited with status {status}")
            if report.failures():
                tail = log_path.read_text(errors="replace").splitlines()[-40:]
                report.problems.append("executor log tail:\n" + "\n".join(tail))
    return report


def _drive(
    settings: StressSettings,
    report: StressReport,
    executor: subprocess.Popen[bytes],
    address: str,
    pool_dir: Path,
    metrics_port: int,
) -> None:
    with ExecutorClient(address, timeout=900) as client:
        client.wait_until_serving(timeout=900)
        info = client.get_executor_info()
        report.device_name = f"{info.device} ({info.backend})"
        for i in range(settings.pinned):
            client.pin_adapter(f"stress-{i}")
    _progress(f"executor serving on {report.device_name}; {settings.clients} clients start")
    clients = []
    modes = settings.client_modes()
    hot = ",".join(f"stress-{i}" for i in range(settings.pinned))
    for i in range(settings.clients):
        mode = modes[i % len(modes)]
        report.by_mode[mode] += 1
        command = [
            sys.executable, "-m", "executor_service.bench.stress_client",
            f"--address={address}", f"--pool={pool_dir}", f"--mode={mode}",
            f"--seconds={settings.seconds}", f"--seed={settings.seed * 1000 + i}",
            f"--tolerance={report.tolerance}", f"--lease={hot}",
            f"--network-device={settings.network_device()}",
        ]  # fmt: skip
        clients.append(
            subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        )
    # Released together once each has started (imports, pool, CUDA context): clients of a real
    # service start elsewhere, so their start-up must not run beside the first requests.
    deadline = time.monotonic() + settings.client_start_seconds
    for proc in clients:
        assert proc.stdout is not None
        readable, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        if readable:
            proc.stdout.readline()  # "ready", or nothing from one that failed (reported below)
        else:
            report.problems.append(
                f"a client did not start within {settings.client_start_seconds:g} s"
            )
            proc.kill()
    for proc in clients:
        assert proc.stdin is not None
        with contextlib.suppress(BrokenPipeError):  # communicate() closes it below
            proc.stdin.write("go\n")
            proc.stdin.flush()
    clients_started = time.time()
    try:
        for proc in clients:
            out, _ = proc.communicate(timeout=settings.seconds + 600)
            if proc.returncode != 0 or not out.strip():
                report.problems.append(f"a client process failed (status {proc.returncode})")
                continue
            result = json.loads(out.strip().splitlines()[-1])
            report.codes.update(result["codes"])
            report.mismatched += result["mismatched"]
            report.mismatches.extend(result["mismatches"][: max(0, 5 - len(report.mismatches))])
            report.worst_row_error = max(report.worst_row_error, result["worst_row_error"])
            report.problems.extend(result["errors"])
            timings = zip(result["latency_s"], result["tokens"], result["started_at"], strict=True)
            report.answers.extend(
                Answer(took, result["mode"], tokens, began - clients_started)
                for took, tokens, began in timings
            )
    finally:
        for proc in clients:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if executor.poll() is not None:
        report.problems.append(f"the executor died during the run (status {executor.returncode})")
        return
    with grpc.insecure_channel(address) as channel:
        status = health_check(channel, timeout=10)
    if status != "SERVING":
        report.problems.append(f"health says {status} after the run")
    _summarise_metrics(report, f"http://127.0.0.1:{metrics_port}/metrics")
