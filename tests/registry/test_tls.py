"""The registry serves TLS with a configured certificate; clients that trust it
connect (with a token), plain-text clients do not."""

from __future__ import annotations

import http.client
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from moelora.client.errors import MoeLoraError
from moelora.client.registry import RegistryClient
from shared.url_ranges import UrlRangeReader, UrlUnreachable, tls_context
from tests.registry.conftest import BASE, Served, register_base
from tests.registry.fixtures import Collect, write_adapter
from tests.tls_certs import self_signed


def test_tls(serve: Callable[..., Served], tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    served = serve(tls_cert_file=cert, tls_key_file=key)
    with RegistryClient(served.address, root_certificates=cert.read_bytes()) as client:
        assert list(client.list_base_models()) == []
    with RegistryClient(served.address, timeout=2) as plain, pytest.raises(MoeLoraError) as info:
        list(plain.list_base_models())
    assert info.value.code == grpc.StatusCode.UNAVAILABLE


def test_blob_urls_are_https_with_the_registrys_certificate(
    serve: Callable[..., Served], tmp_path: Path, base_model_dir: Path
) -> None:
    cert, key = self_signed(tmp_path)
    served = serve(tls_cert_file=cert, tls_key_file=key, http_listen="127.0.0.1:0")
    folder = write_adapter(tmp_path / "a")
    with RegistryClient(served.address, root_certificates=cert.read_bytes()) as client:
        register_base(client, base_model_dir)
        client.upload(folder, "a", BASE)
        urls = {f.file.path: f.url for f in client.download_urls("a:1").files}
    url = urls["adapter_model.safetensors"]
    assert url.startswith("https://127.0.0.1:")
    weights = (folder / "adapter_model.safetensors").read_bytes()
    got = Collect(1000)
    trusting = UrlRangeReader(timeout=10, ssl_context=tls_context(cert.read_bytes()))
    try:
        trusting.read(url, 100, 1000, got)
    finally:
        trusting.close()
    assert bytes(got.data) == weights[100:1100]
    untrusting = UrlRangeReader(timeout=10, ssl_context=tls_context(None))
    with pytest.raises(UrlUnreachable, match="CERTIFICATE_VERIFY_FAILED"):
        untrusting.read(url, 0, 1000, Collect(1000))
    plain = UrlRangeReader(timeout=10)
    with pytest.raises((OSError, http.client.HTTPException)):
        plain.read(url.replace("https://", "http://"), 0, 1000, Collect(1000))
