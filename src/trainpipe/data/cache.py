"""The prepared-data cache: Arrow files under a content key, written atomically.

The key is the SHA-256 of: every source's content hash (file SHA-256s; hub id/config/split;
SQL url and query), format and column mapping, weight/max_records/role, every cleaning,
dedup and decontamination option (benchmark files by content), the tokenizer (its
``tokenizer.json`` serialisation and special tokens), the chat template text, max length,
truncation, packing, label mode, seed, and ``DATA_CODE_VERSION``.

A build is written into ``<key>.tmp-<pid>-<host>-<random>/`` (``host``: 6 hex digits of the host name's SHA-256),
registered before it is made as pending in the cache folder's ownership manifest
(:mod:`trainpipe.ownership`); every file is fsynced, a
``COMPLETE`` manifest with each file's size and SHA-256 is written last, then the folder
is renamed to ``<key>/``. A reader uses an entry only when ``COMPLETE`` is there and every
size matches, so an interrupted write never leaves a cache that a later run reuses.
Splits are Arrow IPC streams, memory-mapped on read (``datasets.Dataset.from_file``).

A build killed before its end (SIGKILL, OOM, power) leaves its temporary folder; :func:`clean_stale`, run
before every build, removes those whose name is trainpipe's, whose host is this one, whose process is no longer
alive here, and which the manifest proves trainpipe's (pending). Anything else in the cache folder is left alone.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import uuid
from pathlib import Path

from trainpipe import ownership
from trainpipe.hashing import file_sha256
from trainpipe.redact import redact_obj

DATA_CODE_VERSION = "6"  # bump when a change to trainpipe/data changes prepared output
HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:6]
_TMP = re.compile(r"^[0-9a-f]{32}\.tmp-(\d+)-([0-9a-f]{6})-[0-9a-f]{8}$")


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def clean_stale(root: Path) -> list[str]:
    """Remove the temporary folders of builds that died (see the module docstring); returns their names. Best effort:
    a folder that cannot be removed (gone meanwhile, not provably ours) is left, and the prepare goes on."""
    root = Path(root)
    removed: list[str] = []
    if not root.is_dir():
        return removed
    for p in sorted(root.iterdir()):
        m = _TMP.match(p.name)
        if m is None or m.group(2) != HOST or _alive(int(m.group(1))) or not p.is_dir() or p.is_symlink():
            continue
        try:
            if ownership.is_ours(p) and ownership.remove(p, what="the temporary folder of a data-cache build whose process died"):
                removed.append(p.name)
        except (OSError, ownership.OwnershipError):
            continue
    return removed


def default_dir() -> Path:
    env = os.environ.get("TRAINPIPE_CACHE")
    if env:
        return Path(env) / "data"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "trainpipe" / "data"


def tokenizer_fingerprint(tokenizer) -> str:
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update((backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))).encode())
    h.update(json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str).encode())
    return h.hexdigest()


def make_key(parts: dict) -> str:
    blob = json.dumps({**parts, "code_version": DATA_CODE_VERSION}, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:32]




def lookup(root: Path, key: str) -> Path | None:
    """The complete cache entry for ``key``, or None (a partial or corrupt entry is never returned)."""
    d = root / key
    marker = d / "COMPLETE"
    if not marker.is_file():
        return None
    try:
        files = json.loads(marker.read_text())["files"]
    except (ValueError, KeyError):
        return None
    for name, meta in files.items():
        p = d / name
        if not p.is_file() or p.stat().st_size != meta["size"]:
            return None
    return d


class Writer:
    """Builds one cache entry in a temporary folder; ``commit()`` makes it visible atomically."""

    def __init__(self, root: Path, key: str):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.key = key
        self.tmp = self.root / f"{key}.tmp-{os.getpid()}-{HOST}-{uuid.uuid4().hex[:8]}"
        ownership.intend(self.root, self.tmp.name)  # pending before it exists: a kill from here on leaves it provably ours
        self.tmp.mkdir()
        self._writers: dict = {}

    def path(self, name: str) -> Path:
        return self.tmp / name

    def write_rows(self, name: str, rows: list[dict]) -> None:
        """Append rows to the Arrow stream ``name`` (created on first use with the rows' schema)."""
        import pyarrow as pa

        if not rows:
            return
        names = list(rows[0])  # what Table.from_pylist does (columns of the first row, None where a row lacks one), by column
        table = pa.Table.from_pydict({n: [r.get(n) for r in rows] for n in names})
        w = self._writers.get(name)
        if w is None:
            sink = pa.OSFile(str(self.tmp / name), "wb")
            w = self._writers[name] = (sink, pa.ipc.new_stream(sink, table.schema))
        w[1].write_table(table)

    def write_json(self, name: str, obj) -> None:
        """Write ``obj`` as JSON, credentials redacted (trainpipe.redact): the cache outlives the run and is shared."""
        (self.tmp / name).write_text(json.dumps(redact_obj(obj), indent=2, default=str), encoding="utf-8")

    def commit(self) -> Path:
        for sink, w in self._writers.values():
            w.close()
            sink.close()
        files = {}
        for p in sorted(self.tmp.iterdir()):
            with open(p, "rb") as fh:
                os.fsync(fh.fileno())
            files[p.name] = {"size": p.stat().st_size, "sha256": file_sha256(p)}
        marker = self.tmp / "COMPLETE"
        with open(marker, "w", encoding="utf-8") as fh:
            json.dump({"key": self.key, "code_version": DATA_CODE_VERSION, "files": files}, fh)
            fh.flush()
            os.fsync(fh.fileno())
        final = self.root / self.key
        if final.exists():  # a concurrent build won, or a stale partial entry
            shutil.rmtree(final, ignore_errors=True)
        os.replace(self.tmp, final)
        ownership.forget(self.root, self.tmp.name)
        return final

    def abort(self) -> None:
        for sink, w in self._writers.values():
            try:
                w.close()
                sink.close()
            except Exception:
                pass
        shutil.rmtree(self.tmp, ignore_errors=True)
        try:
            ownership.forget(self.root, self.tmp.name)
        except OSError:  # a full disk: the manifest cannot be rewritten; a pending mark of a folder now gone is harmless
            data = ownership.read_manifest(Path(self.root))
            if not data["entries"] and set(data["pending"]) <= {self.tmp.name}:
                (Path(self.root) / ownership.MANIFEST).unlink(missing_ok=True)
            return
        _drop_empty_manifest(self.root)  # a failed first build leaves the cache folder as it found it


def _drop_empty_manifest(root: Path) -> None:
    """Remove the cache folder's ownership manifest when it lists nothing (no entry, no pending build). A build that
    registers meanwhile loses only its pending mark: if it is then killed, its temporary is left, never wrongly removed."""
    m = Path(root) / ownership.MANIFEST
    data = ownership.read_manifest(Path(root)) if m.is_file() else None
    if data is not None and not data["entries"] and not data["pending"]:
        try:
            m.unlink()
        except OSError:
            pass


def read_split(entry: Path, name: str):
    """A memory-mapped ``datasets.Dataset`` of split ``name`` (None when the split is empty)."""
    p = entry / name
    if not p.exists():
        return None
    from datasets import Dataset

    return Dataset.from_file(str(p))


def read_rows(entry: Path, name: str) -> list[dict]:
    import pyarrow as pa

    p = entry / name
    if not p.exists():
        return []
    with pa.memory_map(str(p)) as src:
        return pa.ipc.open_stream(src).read_all().to_pylist()
