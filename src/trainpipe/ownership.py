"""The one ownership rule: what trainpipe may write, replace or delete, for every command.

trainpipe never deletes or overwrites what it cannot prove it made. The proof is a manifest,
``.trainpipe-owned.json``, that trainpipe writes into a folder: it lists the entries of that
folder trainpipe created, each with a fingerprint of its content (size and SHA-256; a folder's
fingerprint lists every file below it). A marker file, a familiar name or a plausible layout
prove nothing.

- **A single file** (a launch script, a JSON schema, an eval result, an emitted YAML) is written
  only to a path that does not exist yet, or over a file that the manifest of its folder lists
  with the content trainpipe wrote (the file is unchanged since). Never to a path the command
  reads (the config, its data, the model, the benchmarks) nor inside such a folder. It is written
  atomically (a temporary file, then a rename), and text goes through redaction
  (:mod:`trainpipe.redact`) on its way out.
- **A folder** is cleared or replaced only when every entry in it is proven trainpipe's by the
  folder's manifest; anything else is refused with one paragraph naming the foreign entries,
  and nothing is deleted. A manifest recorded for another path (a folder copied or moved here)
  proves nothing.
- **Writers inside an owned folder** that cannot go through :func:`write_text` (a library's
  ``save_pretrained``, a checkpoint) register a name before they write (:func:`intend`: a
  pending entry) and fingerprint it after (:func:`record`, :func:`seal`). A pending entry is no
  licence: what lies under it must be what its interrupted writer could have produced (its
  temporary names, the shape it declared, the content it was renaming in; :mod:`trainpipe.pending`),
  or it is foreign and named.
- Files that only grow (``*.jsonl`` logs) are fingerprinted by their prefix: appended lines keep
  them trainpipe's; any other change does not (:func:`appended` says how much grew since).

Files over 64 MiB are fingerprinted by size and the SHA-256 of their first and last MiB, so
that sealing a run of multi-GB checkpoints stays cheap; a file whose size, modification time and
inode change time (which no one can set back) are unchanged keeps its recorded fingerprint
without being read again; any other is read.

A core module: it imports only ``errors``, ``redact`` and ``pending``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import stat
import time
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from trainpipe import pending as _pending
from trainpipe.errors import TrainpipeError
from trainpipe.redact import redact_obj, redact_text

MANIFEST = ".trainpipe-owned.json"
LOCK = ".trainpipe.lock"  # a run's lock (rundir.py): transient, trainpipe's by name, never deleted here
BIG = 64 << 20
SAMPLE = 1 << 20
GROWS_SUFFIXES = (".jsonl", ".log")


class OwnershipError(TrainpipeError):
    """A write, replace or delete that the ownership rule refuses; nothing was written or deleted."""

    title = "refusing to write"


# ----------------------------------------------------------------------------- fingerprints
def _sha_file(p: Path, size: int, *, prefix: int | None = None) -> str:
    h = hashlib.sha256()
    n = size if prefix is None else prefix
    with open(p, "rb") as fh:
        if n > BIG:
            h.update(fh.read(SAMPLE))
            fh.seek(n - SAMPLE)
            h.update(fh.read(SAMPLE))
            h.update(str(n).encode())
        else:
            left = n
            while left > 0:
                chunk = fh.read(min(left, 1 << 20))
                if not chunk:
                    break
                h.update(chunk)
                left -= len(chunk)
    return h.hexdigest()


def _fp_file(p: Path, old: dict | None = None, *, grows: bool | None = None) -> dict:
    st = p.lstat()
    if stat.S_ISLNK(st.st_mode):
        return {"link": os.readlink(p)}
    if old and (old.get("size"), old.get("mtime_ns"), old.get("ctime_ns")) == (st.st_size, st.st_mtime_ns, st.st_ctime_ns) and "sha256" in old:
        return old  # unchanged since it was fingerprinted (a modification time put back changes the ctime): not read again
    grows = p.name.endswith(GROWS_SUFFIXES) if grows is None else grows
    fp = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "sha256": _sha_file(p, st.st_size)}
    if grows:
        fp["grows"] = True
    return fp


def _fp(p: Path, old: dict | None = None, accept: Callable[[str], bool] | None = None) -> dict:
    """The fingerprint of a file or a folder (every file below it, by relative path; only those ``accept(rel)`` takes)."""
    if p.is_dir() and not p.is_symlink():
        old_files = (old or {}).get("files", {}) if isinstance(old, dict) else {}
        files = {}
        for f in sorted(_walk(p)):
            rel = f.relative_to(p).as_posix()
            if accept is None or accept(rel):
                files[rel] = _fp_file(f, old_files.get(rel))
        return {"dir": True, "files": files}
    return _fp_file(p, old)


def _walk(folder: Path) -> Iterable[Path]:
    for root, dirs, files in os.walk(folder, followlinks=False):
        r = Path(root)
        for name in files:
            yield r / name
        for name in list(dirs):
            if (r / name).is_symlink():
                dirs.remove(name)
                yield r / name


def _file_matches(p: Path, fp: dict) -> bool:
    try:
        st = p.lstat()
    except OSError:
        return False
    if "link" in fp:
        return stat.S_ISLNK(st.st_mode) and os.readlink(p) == fp["link"]
    if not stat.S_ISREG(st.st_mode):
        return False
    size = fp.get("size")
    if not isinstance(size, int):
        return False
    if st.st_size == size and (st.st_mtime_ns, st.st_ctime_ns) == (fp.get("mtime_ns"), fp.get("ctime_ns")):
        return True  # untouched since trainpipe fingerprinted it (an edit whose mtime was put back still moves the ctime)
    if st.st_size < size or (st.st_size > size and not fp.get("grows")):
        return False
    try:
        return _sha_file(p, st.st_size, prefix=size) == fp.get("sha256")
    except OSError:
        return False


def _mismatches(p: Path, fp: dict, data: dict, rel0: str) -> list[str]:
    """The paths below ``p`` (relative to the manifest's folder) that neither its fingerprint nor a pending entry proves."""
    folder = p.parent
    if not fp.get("dir") or not p.is_dir() or p.is_symlink():
        if p.is_dir() and not p.is_symlink():
            return _unproven_below(folder, rel0, data)
        return [] if _file_matches(p, fp) or _proves(folder, rel0, data) else [rel0]
    files, bad = fp.get("files") or {}, []
    for f in sorted(_walk(p)):
        rel = f.relative_to(p).as_posix()
        if (rel not in files or not _file_matches(f, files[rel])) and not _proves(folder, f"{rel0}/{rel}", data):
            bad.append(f"{rel0}/{rel}")
    return bad


def _is_pending(rel: str, pending: list[str]) -> bool:
    return any(rel == p or rel.startswith(p + "/") for p in pending)


def _unproven_below(folder: Path, rel0: str, data: dict) -> list[str]:
    """The files below ``folder/rel0`` that no pending entry proves, by relative path."""
    base = folder / rel0
    return [r for f in sorted(_walk(base)) if not _proves(folder, r := f"{rel0}/{f.relative_to(base).as_posix()}", data)]


def _proves(folder: Path, rel: str, data: dict) -> bool:
    """Whether the file ``folder/rel`` is what a pending entry's interrupted writer could have left (:func:`trainpipe.pending.proves`)."""
    return _pending.proves(folder, rel, data, _nested)


def _nested(folder: Path, parts: list[str]) -> bool:
    """Whether a folder nested below ``folder`` (a stage's or adapter's run, an export) proves the file ``parts`` by its own
    manifest: the innermost that proves it (an export's manifest lists only its gates' files: the stage's lists the rest)."""
    for i in range(len(parts) - 1, 0, -1):
        sub, rel = folder.joinpath(*parts[:i]), "/".join(parts[i:])
        if (sub / MANIFEST).is_file() and read_manifest(sub)["entries"]:
            if internal(parts[i]) or not any(rel == b or rel.startswith(b + "/") for b in foreign(sub)):
                return True
    return False


# ----------------------------------------------------------------------------- the manifest
def _manifest_path(folder: Path) -> Path:
    return Path(folder) / MANIFEST


def read_manifest(folder: Path) -> dict:
    """The folder's manifest ({} entries when there is none, or it is unreadable, or recorded for another path)."""
    folder = Path(folder).resolve()
    empty = {"version": 1, "path": str(folder), "entries": {}, "pending": []}
    try:
        data = json.loads(_manifest_path(folder).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return empty
    if not isinstance(data, dict) or not isinstance(data.get("entries"), dict) or data.get("path") != str(folder):
        return empty  # a manifest copied or moved here from elsewhere proves nothing about this folder
    data.setdefault("pending", [])
    return data


def _write_manifest(folder: Path, data: dict) -> None:
    folder = Path(folder).resolve()
    data["path"] = str(folder)
    data["updated"] = time.time()
    tmp = folder / f"{MANIFEST}.tmp-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    try:
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True), encoding="utf-8")
        os.replace(tmp, _manifest_path(folder))
    finally:
        if tmp.exists():  # a full disk: no half-written temporary left behind, the old manifest stays
            tmp.unlink()


@contextlib.contextmanager
def _locked(folder: Path):
    """Serialise manifest updates of one folder across processes (tune workers, ranks): flock on the folder itself."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _update(folder: Path, fn: Callable[[dict], None]) -> None:
    folder = Path(folder).resolve()
    with _locked(folder):
        data = read_manifest(folder)
        fn(data)
        _write_manifest(folder, data)


def internal(name: str) -> bool:
    """Whether ``name`` is one of the ownership rule's own files (the manifest, its temporaries, a run's lock)."""
    return name == MANIFEST or name.startswith(MANIFEST + ".tmp-") or name == LOCK or name.startswith(LOCK + ".")


# ----------------------------------------------------------------------------- questions
def foreign(folder: Path) -> list[str]:
    """The entries of ``folder`` (relative paths) that its manifest does not prove trainpipe's; [] for an empty folder."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    data = read_manifest(folder)
    entries, pending = data["entries"], data["pending"]
    bad: list[str] = []
    for p in sorted(folder.iterdir()):
        if internal(p.name):
            continue
        fp = entries.get(p.name)
        if fp is None:
            # a pending folder, or an unlisted one on the way to a pending path (`checkpoints` for `checkpoints/.tmp-step-4-PID`)
            if p.is_dir() and not p.is_symlink() and (_is_pending(p.name, pending) or any(x.startswith(p.name + "/") for x in pending)):
                bad += _unproven_below(folder, p.name, data)
            elif not _proves(folder, p.name, data):
                bad.append(p.name)
            continue
        bad += _mismatches(p, fp, data, p.name)
    return bad


def is_ours(path: Path) -> bool:
    """Whether the file or folder ``path`` is listed, with its current content, in its parent folder's manifest."""
    path = Path(path).resolve() if not Path(path).is_symlink() else Path(os.path.abspath(path))
    data = read_manifest(path.parent)
    fp = data["entries"].get(path.name)
    if fp is None:
        if path.is_dir() and not path.is_symlink():
            return _is_pending(path.name, data["pending"]) and not _unproven_below(path.parent, path.name, data)
        return path.exists() and _proves(path.parent, path.name, data)
    return not _mismatches(path, fp, data, path.name)


def _reads(reads: Iterable[Any]) -> list[tuple[Path, str]]:
    """(absolute path, what it is) of a command's inputs. The working directory and the home directory (which
    ``rundir.protected_paths`` lists because they must never be cleared) are dropped here: files are written inside
    them every day; :func:`_check_not_input` refuses clearing them on its own."""
    out = []
    skip = {Path.cwd().resolve(), Path.home().resolve()}
    for r in reads or ():
        if r is None:
            continue
        if isinstance(r, tuple):
            p, what = r
        else:
            p, what = r, "an input of this command"
        p = Path(p).expanduser().resolve()
        if p not in skip:
            out.append((p, what))
    return out


def _shown(names: list[str], n: int = 5) -> str:
    s = ", ".join(f"`{x}`" for x in names[:n])
    return s + (f" and {len(names) - n} more" if len(names) > n else "")


def check_writable(path: str | Path, *, what: str, reads: Iterable[Any] = ()) -> Path:
    """Raise :class:`OwnershipError` unless ``path`` may be written as a single file (a new path, or a file trainpipe wrote
    there and nobody changed since, and no input of the command); returns the absolute path. Writes nothing."""
    target = Path(os.path.abspath(Path(path).expanduser()))
    real = target.resolve()
    for r, rwhat in _reads(reads):
        if real == r or (r.is_dir() and r in real.parents):
            raise OwnershipError(
                f"Refusing to write {what} to `{target}`: that {'is' if real == r else 'is inside'} {rwhat} (`{r}`), which this "
                f"command reads, and trainpipe never writes over its own inputs. Nothing was written. Choose another output path."
            )
    if target.is_dir() and not target.is_symlink():
        raise OwnershipError(
            f"Refusing to write {what} to `{target}`: that is a folder, and {what} is one file. Nothing was written. "
            f"Name a file, e.g. `{target / 'out'}`."
        )
    if target.exists() or target.is_symlink():
        if not is_ours(target):
            raise OwnershipError(
                f"Refusing to write {what} to `{target}`: a file is already there that trainpipe did not write, or that was "
                f"changed since (no matching entry in `{target.parent / MANIFEST}`), and trainpipe only replaces files it can "
                f"prove it made. Nothing was written. Choose a new path, or move that file away yourself."
            )
    return target


# ----------------------------------------------------------------------------- single files
def write_bytes(path: str | Path, data: bytes, *, what: str, reads: Iterable[Any] = (), mode: int | None = None) -> Path:
    """Write one file by the rule (new path, or trainpipe's own unchanged file; never an input), atomically, and record it."""
    target = check_writable(path, what=what, reads=reads)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        if target.is_symlink():
            target.unlink()
        expect(target.parent, {target.name: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}})  # a kill before record
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()
    record(target)
    return target


def write_text(path: str | Path, text: str, *, what: str, reads: Iterable[Any] = (), mode: int | None = None, redact: bool = True) -> Path:
    """:func:`write_bytes` for text, redacted on its way out (every URL password, secret query value and secret
    environment value -> ``***``)."""
    if redact:
        text = redact_text(text)
    return write_bytes(path, text.encode("utf-8"), what=what, reads=reads, mode=mode)


def write_json(path: str | Path, obj: Any, *, what: str, reads: Iterable[Any] = (), indent: int | None = 2) -> Path:
    """:func:`write_text` for a JSON document (redacted value by value first)."""
    return write_text(path, json.dumps(redact_obj(obj), indent=indent, default=str) + "\n", what=what, reads=reads)


def expect(folder: str | Path, files: dict[str, dict]) -> None:
    """Note ``{rel: {size, sha256}}``, the files a writer is about to rename in below a pending name of ``folder`` (others
    are not noted): until sealed, those files with that content are proven; a name with noted files proves nothing else."""
    if any(_is_pending(r, read_manifest(folder := Path(folder).resolve())["pending"]) for r in files):
        _update(folder, lambda d: (d.__setitem__("expect", _pending.noted(d.get("expect", {}), files)), _drop_pending(d, lambda p: True)))


def _drop_pending(data: dict, keep: Callable[[str], bool]) -> None:
    """Keep only the pending entries ``keep`` takes, with their shapes and expected contents."""
    data["pending"] = [p for p in data["pending"] if keep(p)]
    data.update({key: {k: v for k, v in data[key].items() if _is_pending(k, data["pending"])} for key in ("shapes", "expect") if key in data})


def appended(folder: str | Path) -> list[tuple[str, int]]:
    """(name, lines added) of each append-only log of ``folder`` that grew since trainpipe last fingerprinted it."""
    return _pending.appended(Path(folder), read_manifest(folder)["entries"])


# ----------------------------------------------------------------------------- recording
def record(path: str | Path, *, grows: bool | None = None, accept: Callable[[str], bool] | None = None) -> None:
    """Record ``path`` (a file or a whole folder, just written by trainpipe; of a folder only the files ``accept(rel)``
    takes) in its parent folder's manifest, and drop its pending mark."""
    path = Path(os.path.abspath(Path(path).expanduser()))
    parent = path.parent.resolve()
    path = parent / path.name

    def fn(data: dict) -> None:
        old = data["entries"].get(path.name)
        if path.exists() or path.is_symlink():
            fp = _fp(path, old, accept) if grows is None or path.is_dir() else _fp_file(path, old, grows=grows)
            data["entries"][path.name] = fp
        else:
            data["entries"].pop(path.name, None)
        _drop_pending(data, lambda p: not (p == path.name or p.startswith(path.name + "/")))

    _update(parent, fn)


def intend(folder: str | Path, rel: str | Iterable[str], shapes: dict[str, list[str]] | None = None, begun: float | None = None) -> None:
    """Register ``folder/rel`` (one relative path, or several) as about to be written by trainpipe, with the shape of
    what its writer writes (``shapes[rel]``: globs, :mod:`trainpipe.pending`); until :func:`seal` fingerprints it, only
    what fits that shape, the writer's temporary names or its expected content is accepted under it."""
    folder = Path(folder).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    rels = [rel] if isinstance(rel, str) else list(rel)

    def fn(data: dict) -> None:
        for r in rels:
            if r not in data["pending"]:
                data["pending"].append(r)
            if shapes and shapes.get(r):
                data.setdefault("shapes", {})[r] = list(shapes[r])
        data.update({"begun": begun} if begun else {})  # when the run that registers them began (rundir.seal's `since`)

    _update(folder, fn)


def seal(folder: str | Path, names: Iterable[str] | Callable[[Path], bool] | None = None, *, verify: bool = False,
         since: float | None = None) -> None:
    """Fingerprint entries of ``folder`` into its manifest: the given names, or the entries ``names(path)`` accepts, or
    (None) those already listed or pending. Pending marks of paths that now exist are resolved; those gone are dropped.
    ``verify``: of listed and pending names, only what is proven (:func:`foreign`) or (``since``) changed since then (inode
    change time) is fingerprinted; an unlisted name that is not pending is taken whole (a legacy folder adopted)."""
    folder = Path(folder).resolve()
    if not folder.is_dir():
        return
    bad = _pending.unsealable(folder, foreign(folder), read_manifest(folder), since) if verify else set()

    def fn(data: dict) -> None:
        entries = data["entries"]
        if callable(names):
            chosen = [p.name for p in folder.iterdir() if not internal(p.name) and names(p)]
        elif names is None:
            chosen = []
        else:
            chosen = list(names)
        chosen += [p.split("/")[0] for p in data["pending"]]
        chosen += list(entries)
        for name in dict.fromkeys(chosen):
            p = folder / name
            if name in bad:  # a file not proven: its old entry (if any) stays, and so it stays foreign
                continue
            if p.exists() or p.is_symlink():
                entries[name] = _fp(p, entries.get(name), (lambda rel, n=name: f"{n}/{rel}" not in bad) if bad else None)
            else:
                entries.pop(name, None)
        _drop_pending(data, lambda p: False)

    _update(folder, fn)


def forget(folder: str | Path, name: str) -> None:
    """Drop ``name`` from the folder's manifest (after trainpipe deleted it)."""
    folder = Path(folder).resolve()
    if (folder / MANIFEST).exists():
        _update(folder, lambda d: (d["entries"].pop(name, None), _drop_pending(d, lambda p: p != name and not p.startswith(name + "/"))))


# ----------------------------------------------------------------------------- folders
def _check_not_input(folder: Path, what: str, reads: Iterable[Any], *, deleting: bool) -> None:
    extra = [(Path.cwd().resolve(), "the working directory"), (Path.home().resolve(), "the home directory")] if deleting else []
    for r, rwhat in _reads(reads) + [(p, w) for p, w in extra if p == folder or folder in p.parents]:
        if folder == r or r in folder.parents or (deleting and folder in r.parents):
            rel = "is" if folder == r else ("is inside" if r in folder.parents else "contains")
            raise OwnershipError(
                f"Refusing to {'clear or replace' if deleting else 'write into'} `{folder}` ({what}): it {rel} {rwhat} (`{r}`), "
                f"and trainpipe never {'deletes' if deleting else 'writes over'} a command's inputs, the working directory or the "
                f"home directory. Nothing was written or deleted. Choose an output folder of its own."
            )


def make_dir(folder: str | Path, *, what: str, reads: Iterable[Any] = ()) -> Path:
    """An output folder trainpipe writes files into: created (with an empty manifest inside) when absent; an
    existing one is used as it is (each file written inside still goes through :func:`write_text` and friends)."""
    folder = Path(folder).expanduser().resolve()
    _check_not_input(folder, what, reads, deleting=False)
    if folder.exists() and not folder.is_dir():
        raise OwnershipError(f"Refusing to use `{folder}` as {what}: it is a file, not a folder. Nothing was written. Choose a folder path.")
    if not folder.exists():
        folder.mkdir(parents=True, exist_ok=True)  # exist_ok: another process (a second tune worker) may make it at the same moment
        _write_manifest(folder, {"version": 1, "entries": {}, "pending": []})
    elif not _manifest_path(folder).exists():
        _write_manifest(folder, {"version": 1, "entries": {}, "pending": []})
    return folder


def check_clearable(folder: str | Path, *, what: str, reads: Iterable[Any] = (), keep: Iterable[str] = ()) -> list[str]:
    """Raise :class:`OwnershipError` unless every entry of ``folder`` (but ``keep``) is proven trainpipe's; returns them."""
    folder = Path(folder).expanduser().resolve()
    if not folder.exists():
        return []
    _check_not_input(folder, what, reads, deleting=True)
    if not folder.is_dir() or folder.is_symlink():
        raise OwnershipError(f"Refusing to replace `{folder}` ({what}): it is not a folder trainpipe made. Nothing was deleted. Choose another path.")
    keep = set(keep)
    bad = [n for n in foreign(folder) if n.split("/")[0] not in keep]
    if bad:
        raise OwnershipError(
            f"Refusing to clear or replace `{folder}` ({what}): it holds {_shown(bad)}, which trainpipe did not write or which "
            f"changed since it did (not proven by `{MANIFEST}`), and trainpipe only deletes what it can prove it made. Nothing was "
            f"deleted. Move those entries away yourself, or choose another path."
        )
    return [p.name for p in folder.iterdir() if not internal(p.name) and p.name not in keep]


def clear_dir(folder: str | Path, *, what: str, reads: Iterable[Any] = (), keep: Iterable[str] = ()) -> Path:
    """Delete every entry of ``folder`` (the folder, its manifest and lock stay), only when every one is proven trainpipe's."""
    folder = Path(folder).expanduser().resolve()
    names = check_clearable(folder, what=what, reads=reads, keep=keep)
    for name in names:
        p = folder / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()
        forget(folder, name)
    return folder


def remove(path: str | Path, *, what: str, reads: Iterable[Any] = ()) -> bool:
    """Delete one file or folder only when its parent's manifest proves it trainpipe's (a folder: every file below it);
    False when it does not exist, OwnershipError when it is not provably ours."""
    path = Path(os.path.abspath(Path(path).expanduser()))
    if not (path.exists() or path.is_symlink()):
        return False
    _check_not_input(path, what, reads, deleting=True)
    if not is_ours(path):
        alien = [b for b in foreign(path.parent) if b == path.name or b.startswith(path.name + "/")]
        raise OwnershipError(
            f"Refusing to delete `{path}` ({what}): trainpipe did not write it, or it changed since (not proven by `{path.parent / MANIFEST}`"
            f"{': ' + _shown(alien) if alien else ''}), and trainpipe only deletes what it can prove it made. Nothing was deleted."
        )
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()
    forget(path.parent, path.name)
    return True


def replace_dir(dest: str | Path, build: Callable[[Path], Any], *, what: str, reads: Iterable[Any] = ()) -> Path:
    """Build a folder with ``build(tmp)`` beside ``dest``, then put it in place of ``dest`` (absent, or every entry proven
    trainpipe's: checked before ``build`` runs and again before the swap), recording the new tree. A failure in ``build``
    leaves ``dest`` as it was."""
    dest = Path(dest).expanduser().resolve()
    check_clearable(dest, what=what, reads=reads)
    _check_not_input(dest, what, reads, deleting=True)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    tmp.mkdir()
    old = None
    try:
        build(tmp)
        seal(tmp, lambda p: True)
        _retarget(tmp, dest)
        if dest.exists():
            check_clearable(dest, what=what, reads=reads)
            old = dest.parent / f".{dest.name}.old-{os.getpid()}-{uuid.uuid4().hex[:6]}"
            os.replace(dest, old)
        os.replace(tmp, dest)
    except BaseException:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and old.exists() and not dest.exists():
            os.replace(old, dest)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    record(dest)
    return dest


def _retarget(tmp: Path, dest: Path) -> None:
    """A folder built under a temporary name gets its manifest's path set to where it will live."""
    data = json.loads(_manifest_path(tmp).read_text(encoding="utf-8"))
    data["path"] = str(dest)
    _manifest_path(tmp).write_text(json.dumps(data, indent=1, sort_keys=True), encoding="utf-8")


def claim_dir(folder: str | Path, *, what: str, reads: Iterable[Any] = ()) -> Path:
    """An output folder trainpipe will own whole: created when absent, adopted when empty, kept when every entry is proven
    trainpipe's; refused (nothing written) when it holds anything else."""
    folder = Path(folder).expanduser().resolve()
    _check_not_input(folder, what, reads, deleting=False)
    if folder.exists():
        check_clearable(folder, what=what, reads=reads)
    else:
        folder.mkdir(parents=True)
    if not _manifest_path(folder).exists() or read_manifest(folder).get("path") != str(folder):
        with _locked(folder):
            _write_manifest(folder, {"version": 1, "entries": {}, "pending": []})
    return folder
