"""The files an adapter version is made of, and its digest.

Registry and executor compute the digest independently and must agree to the bit.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
#: Every adapter version holds exactly these files, uploaded in this order.
ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)


def files_digest(sha256_by_path: Mapping[str, str]) -> str:
    """ "sha256:" + SHA-256 over the files sorted by path, each contributing the UTF-8 bytes
    of ``path`` NUL ``lower-case hex sha256`` LF: identical files give identical digests."""
    outer = hashlib.sha256()
    for path in sorted(sha256_by_path):
        outer.update(f"{path}\0{sha256_by_path[path]}\n".encode())
    return f"sha256:{outer.hexdigest()}"


def digest_of_files(files: Mapping[str, bytes]) -> str:
    """The version digest of files held in memory, by path."""
    return files_digest({path: hashlib.sha256(data).hexdigest() for path, data in files.items()})
