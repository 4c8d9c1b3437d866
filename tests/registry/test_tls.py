"""The registry serves TLS with a configured certificate; clients that trust it
connect (with a token), plain-text clients do not."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from shared.errors import MoeLoraError
from shared.registry_client import RegistryClient
from tests.registry.conftest import Served
from tests.tls_certs import self_signed


def test_tls(serve: Callable[..., Served], tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    served = serve(tls_cert_file=cert, tls_key_file=key)
    with RegistryClient(served.address, root_certificates=cert.read_bytes()) as client:
        assert list(client.list_base_models()) == []
    with RegistryClient(served.address, timeout=2) as plain, pytest.raises(MoeLoraError) as info:
        list(plain.list_base_models())
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
