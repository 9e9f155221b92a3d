"""The digest cache: a file's SHA-256 remembered under its stat, so an unchanged re-run does not read every byte again.

`trainpipe pipeline run` needs the SHA-256 of (1) every file of a cached step's outputs, to verify the entry before it
reuses it (cache.py), and (2) the outside inputs of the step keys: the base model folder, the tokenizer, the data files
(dag.py `external_inputs`). Read in full each time, a multi-GB base model costs seconds to minutes per re-run. This
cache keeps, per absolute path, the stat it had when it was hashed, `(size, mtime_ns, ctime_ns, inode, device)`, and
the SHA-256; when the file's stat is still exactly that, the recorded SHA-256 is returned without reading the file.
Anything that changes the stat makes it a miss and the file is hashed again: a rewrite in place (even with the same
size: the mtime moves), a replacement by another file (inode), `touch -d` / `os.utime` putting the old mtime back (the
ctime moves, and no user call sets it), a copy on another disk (device).

Where: a local artefact store keeps it in its root (`<store>/digests.json`); `memory://` keeps it in the process; for a
remote store (`s3://`, `gs://`) the outside inputs (local files) use `$XDG_CACHE_HOME/trainpipe/digests-<store id>.json`
and the store's own files are always read in full (an object store has no inode or ctime to trust).

The trade-off, said plainly: a file whose bytes changed while its stat did not is not re-hashed on the fast path.
Through the file system that needs a write within the same timestamp tick as the hash that was recorded, which the
racy check below excludes; what remains is a change below the file system (bit rot on the disk, a block device written
directly, a restored backup that also restores ctimes and inodes). `trainpipe cache verify` re-hashes every file of
every entry in full and removes an entry whose files fail (the next run rebuilds it); `TRAINPIPE_DIGEST_CACHE=off`
turns the cache off for a process (every file read in full, as before the cache).

Correctness details:
- racy writes (as git's "racily clean" index entries): a hash is recorded only when the file's mtime is older than
  the moment the hashing started by more than the file system's timestamp tick (0.1 s; 2 s on a file system with
  whole-second mtimes), and its stat was the same before and after the read. A file written just before it is hashed
  is hashed again next time, then remembered.
- files trainpipe itself writes into a local store (`store.put_path`) are hashed from the stored copy right after it
  is written (under a temporary name only this process knows) and recorded under that copy's stat, so the first
  re-run already verifies them by stat.
- the cache file is written atomically (tmp + os.replace) through the ownership rule (ownership.py: recorded in its
  folder's manifest; a file of that name trainpipe did not write is never replaced, the cache then stays in memory),
  merged with what another process wrote since it was read; a lost update only costs a re-hash. A cache file that does
  not parse is ignored (everything is hashed again).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from trainpipe import ownership
from trainpipe.data.sources import expand, sha256_path
from trainpipe.hashing import file_sha256
from trainpipe.run import source_sha256 as full

VERSION = 1
TICK_NS = 100_000_000  # 0.1 s: above the coarse kernel clock tick that stamps mtimes (1-10 ms)
COARSE_TICK_NS = 2_000_000_000  # FAT-like file systems with whole-second (or 2 s) mtimes
FLUSH_EVERY_S = 1.0


def enabled() -> bool:
    return os.environ.get("TRAINPIPE_DIGEST_CACHE", "on").strip().lower() not in ("off", "0", "false", "no")


def stat_key(st: os.stat_result) -> list[int]:
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev]


def _tick(st: os.stat_result) -> int:
    return COARSE_TICK_NS if st.st_mtime_ns % 1_000_000_000 == 0 else TICK_NS


class DigestCache:
    """`sha256(path)`: the file's SHA-256, read from the cache when its stat is the recorded one. `path=None`: kept in
    this process only."""

    def __init__(self, path: str | Path | None):
        self.path = Path(path) if path is not None else None
        self._entries: dict[str, dict] | None = None
        self._changed: dict[str, dict | None] = {}  # abs path -> new record (None: forget)
        self._last_flush = time.monotonic()
        self.hits = self.misses = 0
        self.bytes_hashed = 0

    # ------------------------------------------------------------------ the file

    def _read(self) -> dict[str, dict]:
        if self.path is None or not self.path.is_file():
            return {}
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        if not isinstance(data, dict) or data.get("version") != VERSION or not isinstance(data.get("files"), dict):
            return {}
        return {k: v for k, v in data["files"].items() if isinstance(v, dict) and isinstance(v.get("stat"), list) and isinstance(v.get("sha256"), str)}

    @property
    def entries(self) -> dict[str, dict]:
        if self._entries is None:
            self._entries = self._read()
        return self._entries

    def flush(self) -> None:
        """Write the changes since the last flush (merged with the file as it is now), atomically."""
        self._last_flush = time.monotonic()
        if not self._changed or self.path is None:
            self._changed.clear()
            return
        merged = self._read()
        for p, rec in self._changed.items():
            if rec is None:
                merged.pop(p, None)
            else:
                merged[p] = rec
        merged = {p: r for p, r in merged.items() if os.path.exists(p)}  # files deleted since: dropped
        try:  # the ownership rule: atomic, recorded, never over a file of that name trainpipe did not write
            ownership.write_text(self.path, json.dumps({"version": VERSION, "files": merged}, separators=(",", ":")),
                                 what="the digest cache (digests.json)")
        except (OSError, ownership.OwnershipError):
            pass  # a cache that cannot be written only costs re-hashing (a store refuses a foreign digests.json when it opens)
        self._entries = merged
        self._changed.clear()

    def _set(self, p: str, rec: dict | None) -> None:
        if rec is None:
            self.entries.pop(p, None)
        else:
            self.entries[p] = rec
        self._changed[p] = rec
        if time.monotonic() - self._last_flush >= FLUSH_EVERY_S:
            self.flush()

    # ------------------------------------------------------------------ digests

    def sha256(self, path: str | Path) -> str:
        """The SHA-256 of the file at `path` (FileNotFoundError when it is gone: its record is dropped)."""
        p = os.path.abspath(path)
        try:
            st = os.stat(p)
        except FileNotFoundError:
            if p in self.entries:
                self._set(p, None)
            raise
        rec = self.entries.get(p) if enabled() else None
        if rec is not None and rec["stat"] == stat_key(st):
            self.hits += 1
            return rec["sha256"]
        self.misses += 1
        start = time.time_ns()
        sha = file_sha256(p)
        self.bytes_hashed += st.st_size
        after = os.stat(p)
        if stat_key(after) == stat_key(st) and st.st_mtime_ns < start - _tick(st):
            self._set(p, {"stat": stat_key(st), "sha256": sha})
        elif p in self.entries:
            self._set(p, None)
        return sha

    def record(self, path: str | Path, sha256: str) -> None:
        """Remember `sha256` for the file at `path` as it is now: for a file whose bytes the caller wrote itself and
        hashed as it wrote them (the store's copies)."""
        p = os.path.abspath(path)
        self._set(p, {"stat": stat_key(os.stat(p)), "sha256": sha256})

    def forget(self, path: str | Path) -> None:
        p = os.path.abspath(path)
        if p in self.entries:
            self._set(p, None)


_PROCESS: dict[str, DigestCache] = {}


def for_store(url: str, root: str, local: bool) -> DigestCache:
    """The digest cache of an artefact store (one object per store and process)."""
    if url not in _PROCESS:
        if local:
            path: Path | None = Path(root) / "digests.json"
        elif url.startswith("memory://"):
            path = None
        else:
            import hashlib

            base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trainpipe"
            path = base / f"digests-{hashlib.sha256(url.encode()).hexdigest()[:16]}.json"
        _PROCESS[url] = DigestCache(path)
    return _PROCESS[url]


def folder_sha256s(folder: Path, files: list[Path], digests: DigestCache | None) -> dict[str, str]:
    """{name: sha256} of `files` (dag.folder_digest's shape) through `digests` when given."""
    h = digests.sha256 if digests is not None else file_sha256
    out = {f.name: h(f) for f in files}
    if digests is not None:
        digests.flush()
    return out


def source_sha256(src, digests: DigestCache | None) -> str:
    """`trainpipe.run.source_sha256` (the manifest's data hash, the same value) with each data file's SHA-256 through
    the digest cache; a `save_to_disk` folder source is hashed in full as there."""
    import hashlib

    if src.path is None or digests is None:
        return full(src)
    files = [{"path": str(f), "sha256": digests.sha256(f) if f.is_file() else sha256_path(f)} for f in expand(src.path)]
    digests.flush()
    return files[0]["sha256"] if len(files) == 1 else hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()
