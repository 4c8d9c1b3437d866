"""Mutated requests against real servers (a registry and an executor as processes on
127.0.0.1): Forward requests with bad bytes, shapes, dtypes, segment sums, references,
routing and layers; uploads with bad names, file lists, sizes, digests, safetensors, configs
and stream order. After every class of mutations: each answer had a status a client can act
on (never INTERNAL or UNKNOWN), the server is alive, the next good request gives exactly the
answer it gave before, no READY version or blob is left by a refused upload, and RSS is flat
after a warm-up. Short and seeded in ``make test``; ``make fuzz`` sends >= 1,000 Forward and
>= 300 upload mutations and prints the figures."""

from __future__ import annotations

import functools
import json
import math
import random
import struct
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, cast

import grpc
import pytest
import torch

from moelora.client import torch_tensors as torch_codec
from moelora.client.executor import forward_request
from moelora.client.health import health_check
from moelora.v1 import executor_pb2, executor_pb2_grpc, registry_pb2, registry_pb2_grpc, tensor_pb2
from tests.executor.conftest import assert_close
from tests.executor.worlds import Recipe, World, build_world
from tests.live_stack import BASE, Stack, rss_bytes

OK = grpc.StatusCode.OK
INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
#: Codes a malformed request must never get: they say "the server broke", not "you did".
NEVER = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNAVAILABLE}

#: Allowed growth of a server's RSS: from after the warm-up round to the end (Forwards), or
#: from the middle third of the rounds to the last (uploads, which grow the database).
RSS_GROWTH = 0.05

Codes = frozenset[grpc.StatusCode]
ForwardMutation = Callable[[random.Random, executor_pb2.ForwardRequest], Codes]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("fuzz_live")
    world = build_world("qwen3_moe", tmp / "world", [Recipe("alpha", "both", 1)])
    stack = Stack(world, tmp, executor_flags=("--num-slots", "4", "--max-rank", "8"))
    try:
        stack.start(["alpha"])
        yield stack
    finally:
        stack.stop()


def _sizes(request: pytest.FixtureRequest) -> tuple[int, int]:
    """(Forward mutations, upload mutations): full with --long; --fuzz-uploads N sets the
    second."""
    forward, uploads = (1000, 300) if request.config.getoption("--long") else (160, 42)
    return forward, request.config.getoption("--fuzz-uploads") or uploads


# -- Forward ---------------------------------------------------------------------------------


def m_bytes(rng: random.Random, r: executor_pb2.ForwardRequest) -> Codes:
    data = r.hidden_states.data
    cut = rng.randrange(1, len(data))
    r.hidden_states.data = data[:-cut] if rng.random() < 0.5 else data + rng.randbytes(cut)
    return frozenset({INVALID})


def m_shape(rng: random.Random, r: executor_pb2.ForwardRequest) -> Codes:
    t, h = r.hidden_states.shape
    n = len(r.hidden_states.data) // 4
    choice = rng.randrange(5)
    if choice == 0:  # right bytes, wrong hidden size
        shape = [n // (h // 2), h // 2]
    elif choice == 1:
        shape = [n]
    elif choice == 2:
        shape = [1, t, h]
    elif choice == 3:
        shape = [1] * rng.randrange(9, 40) + [t, h]
    else:
        shape = [t * h, 1]
    del r.hidden_states.shape[:]
    r.hidden_states.shape.extend(shape)
    return frozenset({INVALID})


def m_huge_shape(rng: random.Random, r: executor_pb2.ForwardRequest) -> Codes:
    del r.hidden_states.shape[:]
    dims = [rng.choice([2**31, 2**40, 2**63, 2**64 - 1]), rng.choice([0, 1, 64, 2**20])]
    r.hidden_states.shape.extend(dims)
    r.hidden_states.data = rng.randbytes(rng.randrange(0, 64))
    return frozenset({INVALID})


def m_dtype(rng: random.Random, r: executor_pb2.ForwardRequest) -> Codes:
    codes = [tensor_pb2.DATA_TYPE_INT32, tensor_pb2.DATA_TYPE_UINT8, tensor_pb2.DATA_TYPE_BOOL,
             tensor_pb2.DATA_TYPE_FLOAT16, tensor_pb2.DATA_TYPE_INT64, 0, 77, -3]  # fmt: skip
    r.hidden_states.dtype = cast(Any, rng.choice(codes))  # unknown codes on purpose
    return frozenset({INVALID})


def m_segments(rng: random.Random, r: executor_pb2.ForwardRequest) -> Codes:
    t = r.hidden_states.shape[0]
    choice = rng.randrange(4)
    del r.segments[:]
    if choice == 0:  # sum off by some
        r.segments.add(num_tokens=t + rng.choice([-5, -1, 1, 7]) if t > 5 else t + 1)
    elif choice == 1:  # a zero-token segment
        r.segments.add(num_tokens=0, adapter="alpha")
        r.segments.add(num_tokens=t)
    elif choice == 2:  # overflow
        r.segments.add(num_tokens=2**32 - 1)
        r.segments.add(num_tokens=(t + 1) % 2**32)
    else:  # very many segments
        for _ in range(rng.randrange(t + 1, 5000)):
            r.segments.add(num_tokens=1)
    return frozenset({INVALID})


_BAD_NAMES = [
    "../alpha", "alpha/..", "a/b", "a\\b", "al\0pha", "alpha\0", "ålpha", "αλφα",
    " ", "alpha:²", "alpha:٣", "alpha:0", "alpha:-1", "alpha:99999999999", "alpha@",
    "alpha@1", "alpha@sha256:xyz", "alpha@sha256:" + "0" * 64, "alpha:1:2", "@prod", ":1",
    "nosuch", "nosuch:1", "alpha@nosuch",
]  # fmt: skip


def m_reference(rng: random.Random, r: executor_pb2.ForwardRequest) -> Codes:
    choice = rng.randrange(3)
    if choice == 0:
        name = rng.choice(_BAD_NAMES)
    elif choice == 1:
        name = rng.choice("a/\0é😀.:@") * rng.randrange(200, 20000)
    else:
        # Any code point protobuf can carry (surrogates cannot be UTF-8 encoded).
        chars = (chr(rng.randrange(1, 0x2FFFF)) for _ in range(rng.randrange(1, 40)))
        name = "".join(c for c in chars if not 0xD800 <= ord(c) <= 0xDFFF) or "\x01"
    r.segments[0].adapter = name
    return frozenset({INVALID, NOT_FOUND})


def m_routing(rng: random.Random, r: executor_pb2.ForwardRequest) -> Codes:
    t = r.hidden_states.shape[0]
    k = 2
    ids = torch.zeros(t, k, dtype=torch.int32)
    ids[:, 1] = 1
    weights = torch.full((t, k), 0.5)
    choice = rng.randrange(5)
    allowed = {INVALID}
    if choice == 0:
        ids[rng.randrange(t), rng.randrange(k)] = rng.choice([-1, 4, 64, 2**31 - 1, -(2**31)])
    elif choice == 1:
        ids = ids[:, :1]
    elif choice == 2:
        weights = weights[: t - 1]
    elif choice == 3:
        ids = ids.to(torch.float32)
    else:
        weights[0, 0] = float("nan")
        allowed.add(OK)  # NaN weights are the caller's numbers; refusing them is fine too
    r.routing.topk_ids.CopyFrom(_tensor(ids))
    r.routing.topk_weights.CopyFrom(_tensor(weights))
    return frozenset(allowed)


def m_layer(rng: random.Random, r: executor_pb2.ForwardRequest) -> Codes:
    r.layer = rng.choice([3, 1000, 2**31 - 1, 2**32 - 1])
    return frozenset({INVALID, NOT_FOUND, PRECONDITION})


def _tensor(tensor: torch.Tensor) -> tensor_pb2.Tensor:
    return torch_codec.from_torch(tensor)


FORWARD_MUTATIONS: dict[str, ForwardMutation] = {
    "bytes": m_bytes,
    "shape": m_shape,
    "huge_shape": m_huge_shape,
    "dtype": m_dtype,
    "segments": m_segments,
    "reference": m_reference,
    "routing": m_routing,
    "layer": m_layer,
}


def _code(call: Callable[[], object]) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as exc:
        assert isinstance(exc, grpc.Call)
        assert len(exc.details() or "") <= 1024, exc.details()[:200]
        return exc.code()
    return OK


def test_mutated_forward_requests(stack: Stack, request: pytest.FixtureRequest) -> None:
    total, _ = _sizes(request)
    world = stack.world
    layer = world.moe_layers[0]
    segments: list[tuple[int, str | None]] = [(4, "alpha"), (2, None)]
    good = forward_request(layer, world.inputs[layer][:6], segments)
    assert stack.executor is not None
    pid = stack.executor.proc.pid
    with grpc.insecure_channel(stack.executor_address) as channel:
        stub = executor_pb2_grpc.ExecutorStub(channel)
        baseline = stub.Forward(good, timeout=30)
        assert_close(_output(baseline), world.expected(layer, segments))
        rng = random.Random(14)
        counts: Counter[tuple[str, str]] = Counter()
        rss: list[int] = []
        rounds = math.ceil(total / (len(FORWARD_MUTATIONS) * 10))
        sent = 0
        for round_index in range(rounds + 1):  # round 0 is the warm-up
            for name, mutate in FORWARD_MUTATIONS.items():
                for _ in range(10):
                    bad = executor_pb2.ForwardRequest()
                    bad.CopyFrom(good)
                    allowed = mutate(rng, bad)
                    code = _code(functools.partial(stub.Forward, bad, timeout=30))
                    counts[(name, code.name)] += 1
                    sent += round_index > 0
                    ref = bad.segments[0].adapter[:80] if bad.segments else None
                    assert code not in NEVER and code in allowed, (name, code, ref)
                # After each class: alive, and the good request answers exactly as before.
                assert health_check(channel, "moelora.v1.Executor") == "SERVING"
                again = stub.Forward(good, timeout=30)
                assert again.output.data == baseline.output.data, name
            rss.append(rss_bytes(pid))
    growth = rss[-1] / rss[0] - 1
    _report("Forward", sent, counts, rss)
    assert sent >= total
    assert growth < RSS_GROWTH, f"executor RSS grew {growth:.1%} after the warm-up"


def _output(response: executor_pb2.ForwardResponse) -> torch.Tensor:
    return torch_codec.to_torch(response.output).clone()


# -- uploads ---------------------------------------------------------------------------------

Upload = list[registry_pb2.UploadAdapterRequest]


def _files(world: World) -> dict[str, bytes]:
    folder = world.adapter_dir / "alpha"
    return {
        n: (folder / n).read_bytes() for n in ("adapter_config.json", "adapter_model.safetensors")
    }


def _upload(name: str, files: dict[str, bytes], *, base: str = BASE) -> Upload:
    header = registry_pb2.UploadHeader(
        name=name,
        base_model=base,
        files=[registry_pb2.AdapterFile(path=p, size_bytes=len(d)) for p, d in files.items()],
    )
    messages = [registry_pb2.UploadAdapterRequest(header=header)]
    for index, data in enumerate(files.values()):
        for offset in range(0, max(len(data), 1), 64 * 1024):
            chunk = registry_pb2.FileChunk(
                file_index=index, offset=offset, data=data[offset : offset + 64 * 1024]
            )
            messages.append(registry_pb2.UploadAdapterRequest(chunk=chunk))
    return messages


def _weights(files: dict[str, bytes]) -> tuple[dict[str, object], bytes]:
    blob = files["adapter_model.safetensors"]
    n = struct.unpack("<Q", blob[:8])[0]
    return json.loads(blob[8 : 8 + n]), blob[8 + n :]


def _safetensors(header: dict[str, object], data: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def u_name(rng: random.Random, files: dict[str, bytes]) -> tuple[Upload, Codes]:
    name = rng.choice([n for n in _BAD_NAMES if ":" not in n and "@" not in n and n != "nosuch"])
    if rng.random() < 0.3:
        name = rng.choice("a/\0é.") * rng.randrange(129, 50000)
    return _upload(name, files), frozenset({INVALID})


def u_file_list(rng: random.Random, files: dict[str, bytes]) -> tuple[Upload, Codes]:
    choice = rng.randrange(4)
    if choice == 0:
        files = {"../" + k if i == 0 else k: v for i, (k, v) in enumerate(files.items())}
    elif choice == 1:
        files = dict(list(files.items())[:1])
    elif choice == 2:
        files = {**files, rng.choice(["extra.bin", "/etc/passwd", "a\0b", "x" * 5000]): b"x"}
    else:
        files = {k.upper(): v for k, v in files.items()}
    return _upload(f"fl{rng.randrange(10**6)}", files), frozenset({INVALID})


def u_sizes(rng: random.Random, files: dict[str, bytes]) -> tuple[Upload, Codes]:
    messages = _upload(f"sz{rng.randrange(10**6)}", files)
    target = messages[0].header.files[rng.randrange(2)]
    choice = rng.randrange(3)
    if choice == 0:
        target.size_bytes = target.size_bytes + rng.choice([-100, -1, 1, 4096])
    elif choice == 1:
        target.size_bytes = rng.choice([2**40, 2**63, 2**64 - 1])
    else:
        target.sha256 = rng.choice(["0" * 64, "zz", "A" * 64])
    return messages, frozenset({INVALID, EXHAUSTED, grpc.StatusCode.DATA_LOSS})


def u_safetensors(rng: random.Random, files: dict[str, bytes]) -> tuple[Upload, Codes]:
    header, data = _weights(files)
    key = rng.choice([k for k in header if k != "__metadata__"])
    entry = dict(header[key])  # type: ignore[call-overload]
    choice = rng.randrange(6)
    allowed = {INVALID}
    if choice == 0:  # huge declared shape, tiny data
        entry["shape"] = [2**40, 2**20]
    elif choice == 1:
        entry["dtype"] = rng.choice(["I32", "U8", "BOOL", "F8_E4M3", "Q4"])
    elif choice == 2:
        entry["data_offsets"] = [0, rng.randrange(1, 10**12)]
    elif choice == 3:  # NaN in the data
        nan = struct.pack("<f", float("nan"))
        begin = cast(list[int], entry["data_offsets"])[0]
        data = data[:begin] + nan + data[begin + 4 :]
    elif choice == 4:  # truncated
        data = data[: rng.randrange(0, len(data))]
    else:  # random bytes anywhere in the file: may still be a valid adapter
        blob = bytearray(_safetensors(header, data))
        for _ in range(rng.randrange(1, 8)):
            blob[rng.randrange(len(blob))] = rng.randrange(256)
        allowed |= {OK, EXHAUSTED}
        out = {**files, "adapter_model.safetensors": bytes(blob)}
        return _upload(f"st{rng.randrange(10**6)}", out), frozenset(allowed)
    header = {**header, key: entry}
    out = {**files, "adapter_model.safetensors": _safetensors(header, data)}
    return _upload(f"st{rng.randrange(10**6)}", out), frozenset(allowed)


def u_config(rng: random.Random, files: dict[str, bytes]) -> tuple[Upload, Codes]:
    config = json.loads(files["adapter_config.json"])
    key = rng.choice(
        ["r", "lora_alpha", "use_rslora", "target_parameters", "rank_pattern", "peft_type"]
    )
    config[key] = rng.choice([None, -1, 0, 2**70, "x", [], {"(": 1}, [1, 2], float("inf")])
    text = json.dumps(config).encode() if rng.random() < 0.8 else rng.randbytes(100)
    out = {**files, "adapter_config.json": text}
    return _upload(f"cf{rng.randrange(10**6)}", out), frozenset({INVALID, OK})


def u_stream(rng: random.Random, files: dict[str, bytes]) -> tuple[Upload, Codes]:
    messages = _upload(f"sm{rng.randrange(10**6)}", files)
    choice = rng.randrange(5)
    if choice == 0:
        messages = messages[1:] + messages[:1]  # chunks before the header
    elif choice == 1:
        messages = messages[:1]  # no bytes
    elif choice == 2:
        messages[-1].chunk.offset += rng.choice([1, 2**40])
    elif choice == 3:
        messages[-1].chunk.file_index = rng.choice([2, 7, 2**32 - 1])
    else:
        messages.insert(1, registry_pb2.UploadAdapterRequest(header=messages[0].header))
    return messages, frozenset({INVALID})


def u_base(rng: random.Random, files: dict[str, bytes]) -> tuple[Upload, Codes]:
    base = rng.choice(["nosuch", "", "../" + BASE, BASE + "\0"])
    return _upload(f"bm{rng.randrange(10**6)}", files, base=base), frozenset(
        {INVALID, NOT_FOUND, PRECONDITION}
    )


UPLOAD_MUTATIONS = {
    "name": u_name,
    "file_list": u_file_list,
    "sizes": u_sizes,
    "safetensors": u_safetensors,
    "config": u_config,
    "stream": u_stream,
    "base_model": u_base,
}


def _blobs(stack: Stack) -> set[str]:
    root = stack.data_dir / "blobs"
    return {
        str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and ".tmp" not in p.parts
    }


def _ready(stack: Stack) -> dict[str, str]:
    with stack.registry_client() as client:
        return {f"{v.name}:{v.version}": v.digest for v in client.list_versions()}


def test_mutated_uploads(stack: Stack, request: pytest.FixtureRequest) -> None:
    _, total = _sizes(request)
    files = _files(stack.world)
    assert stack.registry is not None
    pid = stack.registry.proc.pid
    rng = random.Random(15)
    counts: Counter[tuple[str, str]] = Counter()
    rss: list[int] = []
    sent = 0
    rounds = math.ceil(total / (len(UPLOAD_MUTATIONS) * 6))
    with grpc.insecure_channel(stack.registry_address) as channel:
        stub = registry_pb2_grpc.AdapterRegistryStub(channel)
        for round_index in range(rounds + 1):
            for name, mutate in UPLOAD_MUTATIONS.items():
                before_ready, before_blobs = _ready(stack), _blobs(stack)
                batch_ok = 0
                for _ in range(6):
                    messages, allowed = mutate(rng, files)
                    code = _code(functools.partial(stub.UploadAdapter, iter(messages), timeout=30))
                    counts[(name, code.name)] += 1
                    sent += round_index > 0
                    batch_ok += code == OK
                    assert code not in NEVER and code in allowed, (name, code)
                ready, blobs = _ready(stack), _blobs(stack)
                # Refused uploads leave nothing: new READY versions and blobs only for accepted.
                assert len(set(ready) - set(before_ready)) == batch_ok, name
                assert len(blobs - before_blobs) <= batch_ok, name
                spool = stack.data_dir / "spool"
                assert not spool.exists() or list(spool.iterdir()) == []
                assert health_check(channel, "moelora.v1.AdapterRegistry") == "SERVING"
                # The next good upload works.
                good = stub.UploadAdapter(iter(_upload("good", files)), timeout=30)
                assert good.version.status == registry_pb2.ADAPTER_STATUS_READY
            rss.append(rss_bytes(pid))
    _report("upload", sent, counts, rss)
    assert sent >= total
    # Each round adds good versions (and the listings that read them), so the registry's RSS
    # rises early and levels off (+7% over 31 rounds, +15% over 151, most of it in the first
    # third); a leak grows with the refused uploads instead: the last third of the rounds may
    # not outgrow the middle third by more than RSS_GROWTH, however long the run.
    middle, end = rss[len(rss) // 3 : 2 * len(rss) // 3], rss[2 * len(rss) // 3 :]
    growth = max(end) / max(middle) - 1
    assert growth < RSS_GROWTH, f"registry RSS grew {growth:.1%} in the last third of the rounds"


def _report(what: str, sent: int, counts: Counter[tuple[str, str]], rss: list[int]) -> None:
    by_code: Counter[str] = Counter()
    for (_, code), n in counts.items():
        by_code[code] += n
    print(
        f"\nfuzz {what}: {sent} mutations after a warm-up of {sum(counts.values()) - sent}; "
        f"codes {dict(sorted(by_code.items()))}; RSS {rss[0] / 2**20:.1f} -> "
        f"{rss[-1] / 2**20:.1f} MiB ({rss[-1] / rss[0] - 1:+.2%}); per round (MiB): "
        + " ".join(f"{r / 2**20:.1f}" for r in rss)
    )
    for (name, code), n in sorted(counts.items()):
        print(f"  {name:12s} {code:20s} {n}")
