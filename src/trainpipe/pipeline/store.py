"""The artefact store of `trainpipe pipeline`: a local folder by default, or any fsspec URL (`file://`, `s3://`, `gs://`,
`memory://`).

Writes are atomic as checkpoints are: a file goes to a temporary name beside its final one and is moved into place
(a rename on a local disk); a folder is written file by file under a temporary prefix and moved. On object stores, where
a move is a copy, the cache entry (`cache.py`) is written last and names every file with its SHA-256, so a reader
never trusts a half-written folder: an entry whose files do not hash as recorded is ignored and rebuilt.

Hashing a stored file on a local store goes through the store's digest cache (digests.py: the SHA-256 remembered under
the file's size, mtime, ctime, inode and device), so verifying an unchanged multi-GB entry costs a stat per file;
`file_sha256(key, full=True)` reads every byte (what `trainpipe cache verify` does).

A store is a folder trainpipe made (issue 22): `.trainpipe-store.json` (the store's layout version) is written when
trainpipe creates the store in an absent or empty folder, and a folder that holds anything but no such marker is
refused as a store (nothing written, nothing deleted): a project's `artifacts/` is never taken for one. On a local
store every file trainpipe writes goes through the ownership rule (ownership.py: written atomically, recorded in the
manifest of its folder, never over a file trainpipe cannot prove it wrote), and `rm` deletes only what the manifest
proves trainpipe's.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path

from trainpipe import ownership
from trainpipe.errors import TrainpipeError
from trainpipe.hashing import file_sha256
from trainpipe.pipeline.digests import for_store, stat_key
from trainpipe.redact import redact_obj
import trainpipe

MARKER = ".trainpipe-store.json"  # written by trainpipe into every store it creates: {"layout": LAYOUT, ...}
LAYOUT = 1


class StoreError(TrainpipeError):
    title = "artefact store"


def _internal(name: str) -> bool:
    """Names of the store's own bookkeeping, never listed as keys: the marker, ownership manifests, pending temporaries."""
    return name == MARKER or name.startswith(MARKER + ".tmp-") or ownership.internal(name)


def _marker_layout(data: bytes | None) -> int | None:
    try:
        obj = json.loads(data) if data is not None else None
    except ValueError:
        return None
    layout = obj.get("layout") if isinstance(obj, dict) else None
    return layout if isinstance(layout, int) and not isinstance(layout, bool) else None


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
        self._open()

    # ------------------------------------------------------------------ the marker

    def _refuse(self, found: list[str]) -> StoreError:
        shown = ", ".join(f"`{n}`" for n in found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
        return StoreError(
            f"`{self.root if self.local else self.url}` is not a trainpipe artefact store: it holds {shown} and no `{MARKER}`, the file "
            f"trainpipe writes into every store it creates, and trainpipe never writes into, garbage-collects or deletes from a folder it "
            f"did not make. Nothing was written or deleted. Give `--store` (or `pipeline.store`) a new or empty folder; a store made by "
            f"a trainpipe older than store markers is only a cache: delete it yourself and the next run rebuilds it."
        )

    def _marker_body(self) -> bytes:
        import time

        return (json.dumps({"layout": LAYOUT, "created": time.time(), "trainpipe": trainpipe.__version__,
                            "what": "a trainpipe artefact store (step cache): trainpipe deletes only what its cache entries list"}, indent=2) + "\n").encode()

    def _check_layout(self, layout: int | None, where: str) -> None:
        if layout is None:
            raise StoreError(f"`{where}` is not a valid store marker (JSON with an integer `layout`), so `{self.url}` is not provably a trainpipe "
                             f"artefact store. Nothing was written or deleted. Give `--store` (or `pipeline.store`) a new or empty folder.")
        if layout > LAYOUT:
            raise StoreError(f"The artefact store `{self.url}` has layout {layout} (`{where}`); this trainpipe reads layout {LAYOUT}. Nothing was "
                             f"written or deleted. Upgrade trainpipe, or give `--store` a new folder.")

    def _open(self) -> None:
        """Use the store when it carries the marker; create it (with the marker) in an absent or empty folder; refuse anything else."""
        if not self.local:
            marker = self.path(MARKER)
            if self.fs.exists(marker):
                self._check_layout(_marker_layout(self.fs.cat_file(marker)), marker)
                return
            try:
                found = [str(p).rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.root, detail=False)]
            except (FileNotFoundError, OSError):
                found = []
            if found:
                raise self._refuse(sorted(found))
            self.fs.makedirs(self.root, exist_ok=True)
            self.put_bytes(MARKER, self._marker_body())
            return
        root = Path(self.root)
        if root.exists() and not root.is_dir():
            raise StoreError(f"`{root}` is a file, not a folder, so it cannot be an artefact store. Nothing was written. Give `--store` "
                             f"(or `pipeline.store`) a new or empty folder.")
        marker = root / MARKER
        if marker.is_file():
            self._check_layout(_marker_layout(marker.read_bytes()), str(marker))
        else:
            found = sorted(p.name for p in root.iterdir() if not _internal(p.name)) if root.is_dir() else []
            if found:
                raise self._refuse(found)
            ownership.make_dir(root, what="the artefact store")
            tmp = root / f"{MARKER}.tmp-{os.getpid()}-{uuid.uuid4().hex[:6]}"
            tmp.write_bytes(self._marker_body())
            try:
                os.link(tmp, marker)  # atomic, and never over a marker another process made at the same moment
            except FileExistsError:
                pass  # another process made the store at the same moment: its marker stands
            except OSError:  # a file system without hard links
                if not marker.exists():
                    os.replace(tmp, marker)
            finally:
                tmp.unlink(missing_ok=True)
            ownership.record(marker)
        # every file trainpipe writes into the store goes through the ownership rule: a user's file by that name is never replaced
        ownership.check_writable(root / "digests.json", what="the store's digest cache (digests.json)")

    @property
    def digests(self):
        """The digest cache of this store (digests.py): `<root>/digests.json` on a local store."""
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
            if not _internal(rel.rsplit("/", 1)[-1]):
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
        """Copy a stored folder (or file) to the local `dest`, through `dest.tmp-*` and a rename. An existing `dest` is
        replaced only when the ownership rule proves every entry of it trainpipe's (OwnershipError, nothing copied or
        deleted, otherwise)."""
        dest = Path(dest)
        if dest.is_dir() and not dest.is_symlink():
            ownership.check_clearable(dest, what=f"the local copy of the artefact `{key}`")
        elif dest.exists() or dest.is_symlink():
            ownership.check_writable(dest, what=f"the local copy of the artefact `{key}`")
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

    def _check_target(self, final: str, what: str) -> None:
        """A local store replaces only what the ownership rule proves trainpipe's (a file it wrote, unchanged since)."""
        if not self.local or not (Path(final).exists() or Path(final).is_symlink()):
            return
        if Path(final).is_dir() and not Path(final).is_symlink():
            if not ownership.is_ours(Path(final)):
                raise ownership.OwnershipError(
                    f"Refusing to replace `{final}` ({what}) in the artefact store `{self.root}`: it holds files trainpipe did not write, or "
                    f"that changed since it did (not proven by `{Path(final).parent / ownership.MANIFEST}`). Nothing was written or deleted. "
                    f"Move that folder out of the store yourself, or give `--store` a new folder.")
        else:
            ownership.check_writable(final, what=what)

    def _begin(self, final: str) -> str:
        """A temporary name beside `final`, registered (local) as trainpipe's before anything is written to it, so that an
        interrupted write leaves a temporary that `cache gc` can prove and remove."""
        parent = final.rsplit("/", 1)[0]
        self.fs.makedirs(parent, exist_ok=True)
        tmp = f"{final}.tmp-{uuid.uuid4().hex[:8]}"
        if self.local:
            ownership.intend(parent, tmp.rsplit("/", 1)[-1])
        return tmp

    def _end(self, tmp: str, final: str | None) -> None:
        """Record `final` (local) and drop the temporary's mark."""
        if not self.local:
            return
        if final is not None:
            ownership.record(final)
        ownership.forget(tmp.rsplit("/", 1)[0], tmp.rsplit("/", 1)[-1])

    def _move(self, tmp: str, final: str) -> None:
        if self.local:
            if Path(final).is_dir() and not Path(final).is_symlink():
                ownership.remove(final, what="an earlier copy of this artefact")  # proven trainpipe's by _check_target
            os.replace(tmp, final)
        else:
            if self.fs.exists(final):
                self.fs.rm(final, recursive=True)
            self.fs.mv(tmp, final, recursive=True)

    def put_bytes(self, key: str, data: bytes) -> str:
        final = self.path(key)
        self._check_target(final, f"the store file `{key}`")
        tmp = self._begin(final)
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
            self._end(tmp, None)
            raise
        self._end(tmp, final)
        return self.uri(key)

    def put_json(self, key: str, obj: dict) -> str:
        return self.put_bytes(key, (json.dumps(redact_obj(obj), indent=2, sort_keys=True, default=str) + "\n").encode())

    def put_path(self, local: Path, key: str, exclude: tuple[str, ...] = ()) -> dict[str, str]:
        """Upload a local file or folder to `key` atomically; returns {relative path: sha256} of what was written
        (a file: {"": sha256})."""
        local = Path(local)
        final = self.path(key)
        self._check_target(final, f"the artefact `{key}`")
        tmp = self._begin(final)
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
                self.fs.put_file(str(local), tmp)
                digests[""] = _file_sha256(Path(tmp) if self.local else local)
            self._move(tmp, final)
        except BaseException:
            if self.fs.exists(tmp):
                self.fs.rm(tmp, recursive=True)
            self._end(tmp, None)
            raise
        self._end(tmp, final)
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
        """Delete `key` (a file or folder); on a local store only when the ownership manifest proves it trainpipe's
        (OwnershipError otherwise, nothing deleted)."""
        p = self.path(key)
        if self.local:
            if ownership.remove(p, what=f"the store entry `{key}`"):
                self._prune(p.rsplit("/", 1)[0])
        elif self.fs.exists(p):
            self.fs.rm(p, recursive=True)

    def replaceable(self, key: str) -> bool:
        """Whether writing `key` may replace what is there: nothing there, or (a local store) what the ownership rule proves
        trainpipe's; a remote store (no manifest) always."""
        if not self.local:
            return True
        p = Path(self.path(key))
        return not (p.exists() or p.is_symlink()) or ownership.is_ours(p)

    def owned(self, key: str) -> bool:
        """Whether the ownership manifest proves `key` trainpipe's (a local store; a remote one has no manifest: False)."""
        return self.local and (Path(self.path(key)).exists() or Path(self.path(key)).is_symlink()) and ownership.is_ours(Path(self.path(key)))

    def remove_listed(self, key: str, files: dict[str, str], *, dry_run: bool = False, written: dict[str, dict] | None = None) -> tuple[list[str], list[str]]:
        """Delete the files of the artefact at `key` that `files` ({relative path: sha256}, a cache entry's record; a file
        artefact: {"": sha256}) lists and whose content still hashes as listed, then the folders left empty; nothing else
        (a file added or changed since stays). `written` (cache verify: the digest cache's records from before its full
        re-hash): a listed file whose stat is still the one recorded there changed only below the file system (bit rot, no
        write through it) and goes too. Returns (keys removed or, `dry_run`, that would be; keys kept)."""
        removed, kept = [], []
        for rel, sha in sorted(files.items()):
            fk = f"{key}/{rel}" if rel else key
            try:
                if self.local and Path(self.path(fk)).is_symlink():
                    raise FileNotFoundError
                same = self.file_sha256(fk) == sha
                if not same and self.local and written:
                    rec = written.get(os.path.abspath(self.path(fk)))
                    same = bool(rec) and rec.get("sha256") == sha and rec.get("stat") == stat_key(os.stat(self.path(fk)))
            except (FileNotFoundError, IsADirectoryError, OSError):
                same = False
            if not same:
                if self.exists(fk):
                    kept.append(fk)
                continue
            removed.append(fk)
            if not dry_run:
                p = self.path(fk)
                if self.local:
                    os.unlink(p)
                    self.digests.forget(p)
                else:
                    self.fs.rm(p)
        if not dry_run:
            for d in sorted({self.path(f"{key}/{rel}").rsplit("/", 1)[0] for rel in files if rel} | {self.path(key).rsplit("/", 1)[0]},
                            key=len, reverse=True):
                self._prune(d)
            if self.local:
                self.digests.flush()
                if not Path(self.path(key)).exists():
                    ownership.forget(self.path(key).rsplit("/", 1)[0], key.rsplit("/", 1)[-1])
        return removed, kept

    def _prune(self, folder: str) -> None:
        """Remove `folder` and its parents up to the root while they are empty (but the store's bookkeeping)."""
        root = self.root.rstrip("/")
        while folder.startswith(root + "/"):
            if self.local:
                p = Path(folder)
                try:
                    names = [x.name for x in p.iterdir()]
                except OSError:
                    return
                if any(not _internal(n) or n.startswith(MARKER) for n in names):
                    return
                for n in names:  # only an ownership manifest (or its temporary) left: the folder's bookkeeping goes with it
                    (p / n).unlink(missing_ok=True)
                try:
                    p.rmdir()
                except OSError:
                    return
                ownership.forget(folder.rsplit("/", 1)[0], p.name)
            else:
                try:
                    if self.fs.ls(folder, detail=False):
                        return
                    self.fs.rmdir(folder)
                except (OSError, NotImplementedError):
                    return
            folder = folder.rsplit("/", 1)[0]


def _file_sha256(path: Path) -> str:
    return file_sha256(path)


def digest_of(files: dict[str, str]) -> str:
    """One SHA-256 for a folder: over its sorted (path, sha256) pairs."""
    return sha256_bytes(json.dumps(sorted(files.items()), separators=(",", ":")).encode())
