"""The artefact store of `trainpipe pipeline`: a local folder by default, or any fsspec URL (`file://`, `s3://`, `gs://`,
`memory://`).

Writes are atomic as checkpoints are: a file goes to a temporary name beside its final one and is moved into place
(a rename on a local disk); a folder is written file by file under a temporary prefix and moved. On object stores, where
a move is a copy, the cache entry (`cache.py`) is written last and names every file with its SHA-256, so a reader
never trusts a half-written folder: an entry whose files do not hash as recorded is ignored and rebuilt.

Hashing a stored file on a local store goes through the store's digest cache (digests.py: the SHA-256 remembered under
the file's size, mtime, ctime, inode and device), so verifying an unchanged multi-GB entry costs a stat per file;
`file_sha256(key, full=True)` reads every byte (what `trainpipe cache verify` does).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path

from trainpipe.errors import TrainpipeError


class StoreError(TrainpipeError):
    title = "artefact store"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class ArtifactStore:
    """Keys are `/`-separated paths under the store's root URL."""

    def __init__(self, url: str | Path):
        import fsspec

        url = str(url)
        try:
            self.fs, root = fsspec.core.url_to_fs(url)
        except (ImportError, ValueError) as exc:
            raise StoreError(
                f"`pipeline.store: {url}` cannot be opened ({exc}). Use a folder, `file:///path`, `memory://name`, or an s3:// / gs:// URL "
                "with its fsspec package installed (s3fs, gcsfs)."
            ) from None
        self.url = url
        self.root = root.rstrip("/")
        self.local = self.fs.protocol in ("file", "local") or "file" in (self.fs.protocol if isinstance(self.fs.protocol, tuple) else ())
        self.fs.makedirs(self.root, exist_ok=True)

    @property
    def digests(self):
        """The digest cache of this store (digests.py): `<root>/digests.json` on a local store."""
        from trainpipe.pipeline.digests import for_store

        return for_store(self.url, self.root, self.local)

    def path(self, key: str) -> str:
        return f"{self.root}/{key}".rstrip("/")

    def uri(self, key: str) -> str:
        p = self.path(key)
        if self.local:
            return Path(p).as_uri()
        proto = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        return f"{proto}://{p.lstrip('/')}" if proto != "memory" else f"memory://{p}"

    def local_path(self, key: str) -> Path | None:
        return Path(self.path(key)) if self.local else None

    # ------------------------------------------------------------------ reads

    def exists(self, key: str) -> bool:
        return self.fs.exists(self.path(key))

    def get_bytes(self, key: str) -> bytes:
        return self.fs.cat_file(self.path(key))

    def get_json(self, key: str) -> dict | None:
        try:
            return json.loads(self.get_bytes(key))
        except (FileNotFoundError, ValueError):
            return None

    def ls(self, prefix: str) -> list[str]:
        """Keys directly under `prefix` (relative to the root)."""
        p = self.path(prefix)
        if not self.fs.exists(p):
            return []
        out = []
        for item in self.fs.ls(p, detail=False):
            item = str(item).rstrip("/")
            rel = item[len(self.root) + 1:] if item.startswith(self.root + "/") else item.lstrip("/")[len(self.root.lstrip("/")) + 1:]
            out.append(rel)
        return sorted(out)

    def walk_files(self, prefix: str) -> dict[str, int]:
        """{relative file path: size} under `prefix`."""
        base = self.path(prefix)
        if not self.fs.exists(base):
            return {}
        out = {}
        for p, info in self.fs.find(base, detail=True).items():
            rel = str(p)[len(base.rstrip("/")) + 1:] if str(p).startswith(base.rstrip("/") + "/") else str(p).lstrip("/")[len(base.strip("/")) + 1:]
            out[rel] = int(info.get("size") or 0)
        return out

    def file_sha256(self, key: str, *, full: bool = False) -> str:
        """The stored file's SHA-256: through the digest cache on a local store, unless `full` (every byte read; the
        digest cache then learns the result)."""
        if self.local:
            if full:
                self.digests.forget(self.path(key))
            return self.digests.sha256(self.path(key))
        h = hashlib.sha256()
        with self.fs.open(self.path(key), "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
        return h.hexdigest()

    def materialize(self, key: str, dest: Path) -> Path:
        """Copy a stored folder (or file) to the local `dest`, through `dest.tmp-*` and a rename."""
        dest = Path(dest)
        tmp = dest.with_name(f"{dest.name}.tmp-{uuid.uuid4().hex[:8]}")
        try:
            src = self.path(key)
            if self.fs.isdir(src):
                for rel in self.walk_files(key):
                    (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                    self.fs.get_file(f"{src}/{rel}", str(tmp / rel))
            else:
                tmp.parent.mkdir(parents=True, exist_ok=True)
                self.fs.get_file(src, str(tmp))
            if dest.is_dir():
                shutil.rmtree(dest)
            elif dest.exists():
                dest.unlink()
            os.replace(tmp, dest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
            raise
        return dest

    # ------------------------------------------------------------------ writes (atomic)

    def _move(self, tmp: str, final: str) -> None:
        if self.local:
            if Path(final).is_dir():
                shutil.rmtree(final)
            os.replace(tmp, final)
        else:
            if self.fs.exists(final):
                self.fs.rm(final, recursive=True)
            self.fs.mv(tmp, final, recursive=True)

    def put_bytes(self, key: str, data: bytes) -> str:
        final = self.path(key)
        self.fs.makedirs(final.rsplit("/", 1)[0], exist_ok=True)
        tmp = f"{final}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            with self.fs.open(tmp, "wb") as fh:
                fh.write(data)
                if self.local:
                    fh.flush()
                    os.fsync(fh.fileno())
            self._move(tmp, final)
        except BaseException:
            if self.fs.exists(tmp):
                self.fs.rm(tmp)
            raise
        return self.uri(key)

    def put_json(self, key: str, obj: dict) -> str:
        from trainpipe.redact import redact_obj

        return self.put_bytes(key, (json.dumps(redact_obj(obj), indent=2, sort_keys=True, default=str) + "\n").encode())

    def put_path(self, local: Path, key: str, exclude: tuple[str, ...] = ()) -> dict[str, str]:
        """Upload a local file or folder to `key` atomically; returns {relative path: sha256} of what was written
        (a file: {"": sha256})."""
        local = Path(local)
        final = self.path(key)
        tmp = f"{final}.tmp-{uuid.uuid4().hex[:8]}"
        digests: dict[str, str] = {}
        try:
            if local.is_dir():
                files = sorted(p for p in local.rglob("*") if p.is_file() and not any(part in exclude for part in p.relative_to(local).parts))
                for f in files:
                    rel = f.relative_to(local).as_posix()
                    self.fs.makedirs(f"{tmp}/{rel}".rsplit("/", 1)[0], exist_ok=True)
                    self.fs.put_file(str(f), f"{tmp}/{rel}")
                    # a local store hashes its own copy (what is stored is what the entry records); a remote one the source
                    digests[rel] = _file_sha256(Path(f"{tmp}/{rel}") if self.local else f)
                if not files:
                    self.fs.makedirs(tmp, exist_ok=True)
            else:
                self.fs.makedirs(final.rsplit("/", 1)[0], exist_ok=True)
                self.fs.put_file(str(local), tmp)
                digests[""] = _file_sha256(Path(tmp) if self.local else local)
            self.fs.makedirs(final.rsplit("/", 1)[0], exist_ok=True)
            self._move(tmp, final)
        except BaseException:
            if self.fs.exists(tmp):
                self.fs.rm(tmp, recursive=True)
            raise
        if self.local:  # the stored copies were hashed after they were written, by this process alone: remembered
            cache = self.digests
            for rel, sha in digests.items():
                try:
                    cache.record(f"{final}/{rel}" if rel else final, sha)
                except OSError:
                    pass
            cache.flush()
        return digests

    def rm(self, key: str) -> None:
        p = self.path(key)
        if self.fs.exists(p):
            self.fs.rm(p, recursive=True)


def _file_sha256(path: Path) -> str:
    from trainpipe.hashing import file_sha256

    return file_sha256(path)


def digest_of(files: dict[str, str]) -> str:
    """One SHA-256 for a folder: over its sorted (path, sha256) pairs."""
    return sha256_bytes(json.dumps(sorted(files.items()), separators=(",", ":")).encode())
