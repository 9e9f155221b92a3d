"""What trainpipe may do to an output folder: own it, lock it, clear it, write below it.

The rules (issue 16, issue 22):

- **Identity.** A run writes the marker ``.trainpipe-run`` (JSON: run id, created time,
  trainpipe version) into its output folder; its checkpoints are labelled with that run id.
  The marker names the run; it proves nothing about what may be deleted (anyone can write or
  copy one).
- **Ownership** is the manifest rule of :mod:`trainpipe.ownership`: ``.trainpipe-owned.json``
  lists the entries trainpipe made, each with a fingerprint of its content. A folder counts as
  - *empty*: nothing but the marker, the lock and the manifest;
  - *prepared*: nothing but ``data/`` as `trainpipe data prepare` wrote it (proven), which a
    run takes as a fresh start;
  - *ours*: every entry proven by the manifest (what lies under the pending names of a run
    that was killed mid-write included, when it is what that writer could have left:
    trainpipe.pending);
  - *foreign*: anything else; the unproven entries are named. A run of a trainpipe older than
    the manifest is foreign too: it is deleted by hand, never by trainpipe.
- **Sealing.** A run seals its folder (:func:`begin`) right after laying it out, and marks the
  names it is about to write as pending, so that a kill at any moment leaves a folder that is
  still provably its own; checkpoints are registered before they are written and fingerprinted
  after the rename (train/checkpoints.py); the run seals again when it ends however it ends
  (:func:`seal`). Entries a person added (notes, an analysis folder) are never sealed.
- **Deletion.** trainpipe clears a folder only when it is ours (``--overwrite``, or a resume
  that finds no checkpoint to continue); never a foreign one, and never one that is or
  contains the config file, a data source, the model folder, the working directory or the home
  directory, even when it is ours. Clearing keeps the folder, the lock, the manifest and the
  marker (rewritten with a new run id).
- **Resume** continues from a checkpoint of the run (checksums verified, labelled with the
  marker's run id); a resume writes beside a person's files and deletes none of them.
- **Lock.** One run per folder: ``.trainpipe.lock`` is created with O_CREAT|O_EXCL and holds
  the pid, host and start time; a lock whose pid is dead on this host is stale and taken over;
  it is released when the run ends, however it ends.
- **Names below the folder** (stage and adapter names) are single path components and the
  path they make must stay inside the folder.
"""

from __future__ import annotations

import json
import os
import socket
import time
import uuid
from collections.abc import Iterable
from pathlib import Path

from trainpipe import __version__
from trainpipe import ownership as owned, ui
from trainpipe.errors import RunDirError
from trainpipe.pending import RUN_SHAPES

MARKER = ".trainpipe-run"  # the run folder's ownership marker (checkpoints/ below it: model/checkpoints.py reads it)


def drop_manifest_tmp(folder: Path) -> None:
    """Remove this process's half-written manifest temporaries in ``folder`` (ownership.py leaves one when its write of
    `.trainpipe-owned.json` fails, e.g. on a full disk)."""
    for p in Path(folder).glob(f"{owned.MANIFEST}.tmp-{os.getpid()}-*"):
        try:
            p.unlink()
        except OSError:
            pass


LOCK = ".trainpipe.lock"
MANIFEST = owned.MANIFEST
# every name trainpipe writes at the top of a run folder (run.py's contract, stages/adapters roots, export, report)
ARTEFACTS = frozenset({
    "config.resolved.yaml", "manifest.json", "events.jsonl", "metrics.jsonl", "data_report.json", "rejected.jsonl",
    "duplicates.jsonl", "checkpoints", "model", "model.tmp", "summary.json", "measured_memory.json", "baseline.json",
    "base", "base.tmp", "export", "adapters", "adapters.json", "report.html", "report",
    # evaluation, gates and the report (evaluate/, report/html.py); tracking and pipeline state (track/, pipeline/dag.py)
    "gates.json", "lengths.json", "review_samples.jsonl", "review.json", "forgetting.json", "benchmarks_baseline.json",
    "tracking.json", "plan.json", "pipeline.json", "tensorboard", "wandb", ".pipeline-step.json",
    ".trainpipe-store",  # the step cache of `trainpipe run` with stages/adapters (pipeline/run.py RUN_STORE)
})
PREPARE_FILES = frozenset({"report.json", "rejected.jsonl", "duplicates.jsonl"})  # what `trainpipe prepare` writes into OUTPUT_DIR/data/


# ----------------------------------------------------------------------------- identity marker
def read_marker(folder: Path) -> dict | None:
    try:
        data = json.loads((Path(folder) / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("run_id") else None


def write_marker(folder: Path, *, legacy: bool = False) -> dict:
    """Name ``folder``'s run with a new run id (atomically: a reader sees the old marker or the new one)."""
    marker = {"run_id": uuid.uuid4().hex, "created": time.time(), "trainpipe": __version__, "pid": os.getpid(), "host": socket.gethostname()}
    if legacy:
        marker["accepts_unlabelled_checkpoints"] = True  # adopted from a trainpipe without markers: its checkpoints carry no run id
    tmp = Path(folder) / f"{MARKER}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(marker, indent=2), encoding="utf-8")
    os.replace(tmp, Path(folder) / MARKER)
    owned.record(Path(folder) / MARKER)
    return marker


def _internal(name: str) -> bool:
    """The marker, the lock and the manifest (and their temporary files): trainpipe's by name, never a run's content."""
    return (name in (MARKER, LOCK, MANIFEST) or name.startswith((MARKER + ".tmp-", LOCK + ".", MANIFEST + ".tmp-")))


def entries(folder: Path) -> list[Path]:
    """What is in ``folder`` besides trainpipe's own marker, lock and manifest."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if not _internal(p.name))


def unproven(folder: Path) -> list[str]:
    """The entries of ``folder`` (relative paths) that its manifest does not prove trainpipe's (the marker aside)."""
    return [n for n in owned.foreign(Path(folder)) if not _internal(n.split("/")[0])]


def ownership(folder: Path) -> tuple[str, list[str]]:
    """("empty" | "prepared" | "ours" | "foreign", the unproven entries) by the manifest rule (module docstring)."""
    folder = Path(folder)
    items = entries(folder)
    if not items:
        return "empty", []
    bad = unproven(folder)
    if bad:
        return "foreign", bad
    if [p.name for p in items] == ["data"] and all(f.name in PREPARE_FILES or _internal(f.name) for f in items[0].iterdir()):
        return "prepared", []
    return "ours", []


def is_artefact(p: Path, parts: Iterable[str] = ()) -> bool:
    """An entry a run writes at the top of its folder: the marker, a name of :data:`ARTEFACTS`, a sub-run folder of
    ``parts`` (stage names). `data/` is sealed only by `trainpipe data prepare` (data/commands.py)."""
    return p.name == MARKER or p.name in ARTEFACTS or p.name in set(parts)


def seal(folder: Path, parts: Iterable[str] = (), *, strict: bool = False) -> None:
    """Fingerprint the run's artefacts in ``folder`` (:func:`is_artefact`) and resolve every pending entry. A person's
    files (not artefact names) are never sealed. Of what lies under the names, only what the ownership rule proves (under
    a pending name: what its writer produced or could have left, pending.py); a file a person put there, even while the
    run was going, stays foreign (issue 36). A folder no run began (no `begun`, not ``strict``) is taken whole (legacy).
    A missing folder is left missing."""
    folder = Path(folder)
    if folder.is_dir():
        parts = list(parts)
        begun = owned.read_manifest(folder).get("begun")
        try:  # of what lies under a listed or pending name, only what the rule proves: a file a person added mid-run stays foreign
            owned.seal(folder, lambda p: is_artefact(p, parts), verify=strict or bool(begun))
        except OSError:  # a full disk: no half-written manifest left beside the old one
            drop_manifest_tmp(folder)
            raise


def begin(folder: Path, parts: Iterable[str] = ()) -> None:
    """A run starts writing ``folder``: seal what is there, then register every artefact name (and sub-run folder) as
    pending, so that a kill at any moment leaves a folder that is still provably the run's (:func:`seal` at the end
    fingerprints them)."""
    parts = list(parts)
    seal(folder, parts, strict=True)
    try:  # each with the shape of what its writer writes (pending.py): a kill leaves only that provable under the name
        owned.intend(folder, sorted(ARTEFACTS | set(parts)), shapes=RUN_SHAPES, begun=time.time())
    except OSError:
        drop_manifest_tmp(folder)
        raise


# ----------------------------------------------------------------------------- protected paths
def protected_paths(cfg, config_path: str | None) -> list[tuple[Path, str]]:
    """Everything a run reads and must never delete: (absolute path, what it is)."""
    out: list[tuple[Path, str]] = []

    def add(p, what: str) -> None:
        if p:
            out.append((Path(p).expanduser().resolve(), what))

    if config_path:
        add(config_path, "the config file")
    datas = ([cfg.data] if cfg.data is not None else []) + [a.data for a in cfg.method.adapters] + [s.data for s in cfg.stages or [] if s.data is not None]
    for data in datas:
        for src in data.sources:
            if src.path:
                add(glob_base(src.path), f"the data source `{src.path}`")
            if src.sql is not None and src.sql.url.startswith("sqlite:///"):
                add(src.sql.url[len("sqlite:///"):] or None, f"the SQLite database of `{src.sql.url}`")
        for b in data.decontamination.benchmarks:
            add(glob_base(b), f"the decontamination benchmark `{b}`")
    model = Path(cfg.model.name_or_path).expanduser() if cfg.model.name_or_path else None
    if model is not None and model.exists():
        add(model, f"the model folder `{cfg.model.name_or_path}`")
    for spec in (cfg.model.factory, cfg.data.factory if cfg.data else None, cfg.method.loss):  # your own code files (model/custom.py)
        if spec and ".py:" in spec and Path(spec.rpartition(":")[0]).is_file():
            add(Path(spec.rpartition(":")[0]), f"the Python file `{spec}`")
    reward = cfg.method.rl.reward_model
    if reward and Path(reward).expanduser().exists():
        add(reward, f"the reward model `{reward}`")
    add(Path.cwd(), "the working directory")
    add(Path.home(), "the home directory")
    return out


def glob_base(path: str) -> str:
    """The fixed folder in front of a glob's first wildcard (the path itself when it has none)."""
    parts = Path(path).parts
    for i, part in enumerate(parts):
        if any(ch in part for ch in "*?["):
            return str(Path(*parts[:i])) if i else "."
    return path


def _covers(folder: Path, p: Path) -> bool:
    return p == folder or folder in p.parents


def check_not_data(folder: Path, protected: list[tuple[Path, str]], key: str = "output_dir") -> None:
    """Refuse an output folder that is, or contains, a data source (a run writes and clears its output folder)."""
    folder = Path(folder).resolve()
    for p, what in protected:
        if what.startswith(("the data source", "the SQLite", "the decontamination")) and _covers(folder, p):
            raise RunDirError(
                f"`{key}` is `{folder}`, which {'is' if p == folder else 'contains'} {what} (`{p}`): a run writes into its "
                f"output folder and may clear it, so it must never hold the run's inputs. Nothing was written or deleted. "
                f"Choose an output folder outside the data, e.g. `--set {key}=runs/NEW_NAME`."
            )


def clear(folder: Path, *, overwrite: bool, protected: list[tuple[Path, str]], why: str) -> None:
    """Empty ``folder`` for a fresh run, by the ownership rules above; refuse (deleting nothing) otherwise.

    Keeps the folder itself, the lock, the manifest and the marker; the caller writes a new marker afterwards."""
    folder = Path(folder).resolve()
    for p, what in protected:
        if _covers(folder, p):
            raise RunDirError(
                f"Refusing to clear `{folder}` ({why}): it {'is' if p == folder else 'contains'} {what} (`{p}`), and trainpipe "
                f"never deletes a run's inputs, the working directory or the home directory, even with `--overwrite`. "
                f"Nothing was deleted. Choose an output folder of its own, e.g. `--set output_dir=runs/NEW_NAME`."
            )
    kind, bad = ownership(folder)
    if kind == "empty":
        return
    if kind == "foreign":
        raise RunDirError(refusal(folder, bad, why))
    grown = owned.appended(folder)
    owned.clear_dir(folder, what=f"the run folder ({why})", keep=[MARKER])
    if grown:  # lines appended to a log are accepted as the run's (a log only grows), but say that they went with it
        logs = ", ".join(f"{n} line(s) of `{name}`" for name, n in grown)
        ui.console().print(f"note: {why} deleted {logs} appended since trainpipe last fingerprinted them (a run appends after its "
                           f"last seal when it is killed; lines you added went too).", markup=False, highlight=False)


def refusal(folder: Path, bad: list[str], why: str) -> str:
    """The one paragraph of a refused clear: which entries are unproven, that nothing was deleted, what to do."""
    shown = ", ".join(f"`{n}`" for n in bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
    return (
        f"Refusing to clear `{folder}` ({why}): it holds {shown}, which trainpipe cannot prove it wrote (its manifest "
        f"`{MANIFEST}` does not list them with their current content: added or changed since the run, or the folder came "
        f"from elsewhere; a `{MARKER}` marker proves nothing), and trainpipe only deletes what it can prove it made, even "
        f"with `--overwrite`. Nothing was deleted. Move those entries away yourself, or choose another output folder "
        f"(`--set output_dir=runs/NEW_NAME`); if this is a run of an older trainpipe (before `{MANIFEST}`), delete the "
        f"folder by hand to start over."
    )


def inside(root: Path, name: str, what: str) -> Path:
    """``root / name`` for a single-component ``name`` whose path stays inside ``root``; RunDirError otherwise."""
    check_name(name, what)
    root = Path(root).resolve()
    path = (root / name).resolve()
    if path.parent != root:
        raise RunDirError(f"{what} `{name}` leads to `{path}`, outside `{root}`. Use a plain folder name (letters, digits, `_`, `-`, `.`).")
    return path


def check_name(name: str, what: str) -> None:
    bad = not name or name in (".", "..") or ".." in name or "/" in name or "\\" in name or "\0" in name or (os.altsep and os.altsep in name) or name.startswith(".")
    if bad:
        raise RunDirError(
            f"{what} `{name}` is not a plain folder name: it becomes a folder under `output_dir`, so it must not be empty, start "
            f"with `.`, contain `..` or a path separator. Use letters, digits, `_`, `-` and `.` (e.g. `sft`, `reward-2`)."
        )


# ----------------------------------------------------------------------------- lock
class RunLock:
    """One run per folder: ``.trainpipe.lock`` (O_CREAT|O_EXCL) with pid, host and start time; stale when its pid is dead
    on this host. Use as a context manager; it creates the folder when missing and removes it again on release when the
    run left it empty."""

    def __init__(self, folder: Path):
        self.folder = Path(folder).resolve()
        self.path = self.folder / LOCK
        self.token = uuid.uuid4().hex
        self.created_folder = False
        self.held = False

    def __enter__(self) -> "RunLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self) -> None:
        if int(os.environ.get("RANK", "0") or 0) > 0:  # torchrun: rank 0 holds the lock for the whole job
            return
        if self.folder.exists() and not self.folder.is_dir():  # `output_dir` names a file: one paragraph, not NotADirectoryError (issue 22)
            raise RunDirError(f"`output_dir` `{self.folder}` is a file, not a folder. Nothing was written. Choose a folder for the run's "
                              "output (`--set output_dir=runs/NAME`); trainpipe creates it when missing.")
        if not self.folder.exists():
            self.folder.mkdir(parents=True)
            self.created_folder = True
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder is None or not self._stale(holder):
                    raise self._busy(holder) from None
                try:
                    self.path.unlink()  # a stale lock of a killed run
                except FileNotFoundError:
                    pass
                continue
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "token": self.token}, fh)
                fh.flush()
                os.fsync(fh.fileno())
            self.held = True
            return
        raise self._busy(self._holder())

    def release(self) -> None:
        if self.held:
            holder = self._holder()
            if holder is not None and holder.get("token") == self.token:
                try:
                    self.path.unlink()
                except FileNotFoundError:
                    pass
            self.held = False
        if self.created_folder and self.folder.is_dir() and not entries(self.folder) and not (self.folder / MARKER).exists():
            for p in self.folder.iterdir():  # refused before anything was written: leave no trace (an empty manifest at most)
                if p.name == MANIFEST and not owned.read_manifest(self.folder)["entries"]:
                    p.unlink()
            if not any(self.folder.iterdir()):
                self.folder.rmdir()

    def _holder(self) -> dict | None:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
            return data if isinstance(data, dict) else {}
        except FileNotFoundError:
            return {"gone": True}
        except (OSError, ValueError):
            return {}  # being written right now, or garbage

    def _stale(self, holder: dict) -> bool:
        if holder.get("gone"):
            return True
        pid = holder.get("pid")
        if not isinstance(pid, int):  # unreadable: stale once it is old enough not to be mid-write
            try:
                return time.time() - self.path.stat().st_mtime > 10
            except FileNotFoundError:
                return True
        if holder.get("host") != socket.gethostname():
            return False  # another machine's run: its pid cannot be checked from here
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False

    def _busy(self, holder: dict | None) -> RunDirError:
        h = holder or {}
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(h["started"])) if isinstance(h.get("started"), (int, float)) else "unknown"
        return RunDirError(
            f"`{self.folder}` is in use by another trainpipe run (pid {h.get('pid', 'unknown')} on {h.get('host', 'unknown host')}, "
            f"started {started}; lock file `{self.path}`): only one run may write an output folder at a time. Nothing was "
            f"written or deleted. Wait for it to finish, or use another folder with `--set output_dir=runs/NEW_NAME`; if that "
            f"run is gone (e.g. its machine died), delete the lock file."
        )
