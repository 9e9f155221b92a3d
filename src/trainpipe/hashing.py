"""SHA-256 of files, streamed (checkpoint manifests, the data cache, lineage, data hashes)."""

from __future__ import annotations

import hashlib
from pathlib import Path


def update_from_file(h, path: str | Path) -> None:
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    update_from_file(h, path)
    return h.hexdigest()
