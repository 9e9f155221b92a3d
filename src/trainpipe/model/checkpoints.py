"""Checkpoints a reader never sees half of, and that are verified before use.

A checkpoint is written into a temporary sibling folder (``.tmp-step-N``): the trainable
weights as safetensors, the training state (optimizer, scheduler, grad scaler, RNG streams,
loop position) as ``state.pt``, the resolved config, then ``manifest.json`` with the size and
SHA-256 of every file. Every file and the folder are fsynced, then the folder is renamed to
``step-N``. Loading verifies the manifest first and reads the state with ``weights_only=True``.

Other tools open a checkpoint as it is (issue 14.3): under PEFT it also holds ``adapter_config.json`` and
``adapter_model.safetensors`` (``AutoPeftModelForCausalLM.from_pretrained(step-N)``); a full fine-tune holds
``config.json`` and ``model.safetensors`` (``AutoModelForCausalLM.from_pretrained(step-N)``; a hard link to the
weights file when every weight trains, so it costs no space). The loop writes them through ``extra``; the
manifest's checksums cover every file. ``trainpipe export RUN_DIR --checkpoint step-N`` exports one of them.

Retention: the newest ``keep_last`` checkpoints plus the best ``keep_best`` by eval metric (``metric``: lower is better;
the loop stores the eval loss, or minus a greater-is-better ``training.metric_for_best``, naming it in ``metric_name`` and
its measured ``metric_value``);
the best is never deleted. A checkpoint saved between evaluations (``save_steps`` that is not a
multiple of ``eval_steps``) has no metric: it counts only among the newest ``keep_last``; the loop
saves every evaluation that is the best so far, so the best ``keep_best`` are evaluated weights.

Ownership: the run folder's marker ``.trainpipe-run`` (rundir.py) names the run; every
checkpoint's manifest carries that ``run_id``, and listing, best, latest and rotation only ever
consider the run's own checkpoints (one a foreign process dropped into ``checkpoints/`` is neither
exported nor resumed from nor deleted). Without a marker (a bare folder) every checkpoint counts.
The marker only names the run; what may be deleted is proven by the run folder's manifest
(ownership.py, ``.trainpipe-owned.json``): a save registers its temporary folder there before
writing (a kill mid-write leaves a folder still provably the run's) and fingerprints
``checkpoints/`` after the rename; rotation fingerprints it again after deleting. A checkpoint
that fails its checksum therefore no longer matches the manifest either.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from trainpipe import faults, ownership, pending
from trainpipe.errors import TrainpipeError
from trainpipe.hashing import file_sha256
from trainpipe.rundir import MARKER as RUN_MARKER, drop_manifest_tmp  # the run folder's marker (the parent of checkpoints/)

WEIGHTS = "weights.safetensors"
STATE = "state.pt"
MANIFEST = "manifest.json"
_NAME = re.compile(r"^step-(\d+)$")


class CheckpointFailed(TrainpipeError):
    """A checkpoint could not be written and `training.on_checkpoint_error: stop` (every rank of a run raises it alike)."""

    exit_code = 1
    title = "checkpoint failed"


class CheckpointWriteError(OSError):
    """A checkpoint could not be written; the previous checkpoints are intact."""


class CheckpointUnreadable(TrainpipeError):
    """A checkpoint file its manifest vouches for that safetensors or the weights-only unpickler refuses (exit 2)."""

    def __init__(self, file: Path, exc: BaseException):
        text = str(exc)
        why = text.split("WeightsUnpickler error:", 1)[1] if "WeightsUnpickler error:" in text else text
        why = " ".join(why.strip().split("\n\n")[0].split())[:200] or type(exc).__name__
        super().__init__(
            f"The checkpoint file `{file}` cannot be read safely ({why}). trainpipe reads weights with safetensors and training "
            f"state with PyTorch's weights-only loader, which accepts tensors and plain values only; this file holds something "
            f"else (a header or offsets past any real file, or pickled objects that would run code), so it was not written by "
            f"trainpipe or was changed since. Nothing was loaded from it. Move `{file.parent}` away to resume from the checkpoint "
            f"before it, or start over with `--overwrite`.")


def write_error(exc: BaseException, where: Path | None = None) -> OSError | None:
    """The OSError behind a failed write, or None when ``exc`` is not one.

    Libraries report a full disk differently: Python file IO raises OSError; ``torch.save`` into an
    open file raises RuntimeError with the OSError as its context; safetensors raises SafetensorError
    whose text ends in ``os error N``. As a last resort, a write that failed on a file system with no
    space left (``where``) is ENOSPC.
    """
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError):
            return seen
        seen = seen.__cause__ or seen.__context__
    m = re.search(r"os error (\d+)", str(exc))
    if m:
        return OSError(int(m.group(1)), os.strerror(int(m.group(1))))
    if where is not None and isinstance(exc, RuntimeError):
        try:
            full = os.statvfs(where).f_bavail == 0
        except OSError:
            return None
        if full:
            return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return None


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class CheckpointInfo:
    path: Path
    step: int
    metric: float | None  # the ranking score, lower is better: the eval loss, or minus a greater-is-better `metric_for_best`
    run_id: str | None = None
    metric_name: str | None = None  # what `metric` ranks by (`loss`, `accuracy`, ...); None in checkpoints written before it was recorded
    metric_value: float | None = None  # that metric's measured value (accuracy 0.8 where `metric` is -0.8)
    eval_loss: float | None = None  # the eval loss of the same evaluation


def verify(path: Path) -> str | None:
    """None if the checkpoint at ``path`` is complete and its checksums hold, else the reason."""
    man = path / MANIFEST
    if not man.is_file():
        return "no manifest.json (write never finished)"
    try:
        manifest = json.loads(man.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        return f"unreadable manifest.json ({exc})"
    for name, meta in manifest.get("files", {}).items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != meta["size"]:
            return f"{name} has {f.stat().st_size} bytes, manifest says {meta['size']} (truncated)"
        if file_sha256(f) != meta["sha256"]:
            return f"{name} fails its SHA-256 check"
    if WEIGHTS not in manifest.get("files", {}) or STATE not in manifest.get("files", {}):
        return "manifest lists no weights or state"
    return None


def _run_identity(run_dir: Path) -> tuple[str | None, bool]:
    """(run id, accepts checkpoints without one) from the run folder's marker; (None, True) without a marker."""
    try:
        marker = json.loads((run_dir / RUN_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None, True
    if not isinstance(marker, dict) or not marker.get("run_id"):
        return None, True
    return str(marker["run_id"]), bool(marker.get("accepts_unlabelled_checkpoints"))


def _manifest_run_id(path: Path) -> str | None:
    try:
        return json.loads((path / MANIFEST).read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None


class CheckpointManager:
    def __init__(self, root: str | Path, keep_last: int = 2, keep_best: int = 1):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.keep_last = keep_last
        self.keep_best = keep_best
        self.run_id, self.accepts_unlabelled = _run_identity(self.root.parent)

    # ----------------------------------------------------------------- listing
    def all(self) -> list[CheckpointInfo]:
        """This run's checkpoints, oldest first (every checkpoint when the run folder has no marker)."""
        return [c for c in self.everything() if self.owns(c)]

    def owns(self, info: CheckpointInfo) -> bool:
        if self.run_id is None:
            return True
        return info.run_id == self.run_id or (info.run_id is None and self.accepts_unlabelled)

    def everything(self) -> list[CheckpointInfo]:
        out = []
        for p in self.root.iterdir():
            m = _NAME.match(p.name)
            if m and p.is_dir():
                metric = run_id = None
                labels: dict = {}
                try:
                    man = json.loads((p / MANIFEST).read_text())
                    metric, run_id = man.get("metric"), man.get("run_id")
                    labels = {k: man.get(k) for k in ("metric_name", "metric_value", "eval_loss")}
                except (OSError, json.JSONDecodeError, AttributeError):
                    pass
                out.append(CheckpointInfo(p, int(m.group(1)), metric, run_id, **labels))
        return sorted(out, key=lambda c: c.step)

    def latest_valid(self, on_skip=None) -> CheckpointInfo | None:
        """The newest checkpoint whose checksums hold; ``on_skip(info, reason)`` for each corrupted one."""
        for info in reversed(self.all()):
            reason = verify(info.path)
            if reason is None:
                return info
            if on_skip:
                on_skip(info, reason)
        return None

    def best(self) -> CheckpointInfo | None:
        scored = [c for c in self.all() if c.metric is not None and verify(c.path) is None]
        return min(scored, key=lambda c: (c.metric, c.step)) if scored else None

    # ----------------------------------------------------------------- writing
    def save(self, step: int, *, weights: dict, state: dict, config_yaml: str, metric: float | None, info: dict, extra=None,
             labels: dict | None = None) -> CheckpointInfo:
        """Write checkpoint ``step`` atomically; raises CheckpointWriteError (nothing half-written remains). ``extra(folder)``
        writes further files (the interoperable adapter or model files) into the folder before the manifest is made. ``labels``
        (`metric_name`, `metric_value`, `eval_loss`) say what the ranking score ``metric`` is; they go into the manifest and
        trainer_state.json."""
        labels = {k: v for k, v in (labels or {}).items() if v is not None}
        import torch
        from safetensors.torch import save_file

        final = self.root / f"step-{step}"
        tmp = self.root / f".tmp-step-{step}-{os.getpid()}"
        try:
            self._intend(tmp.name)  # a full disk here is a failed write like any other (CheckpointWriteError)
            # and the name it is renamed to: a kill between the rename and the seal leaves `step-N` pending, proven file by
            # file by its own manifest (before, it was neither listed nor pending: foreign to the next --overwrite)
            self._intend(final.name, shapes=[pending.LISTED])
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
            save_file({k: v.detach().contiguous() for k, v in weights.items()}, str(tmp / WEIGHTS), metadata={"step": str(step), "format": "pt"})
            faults.during_checkpoint_write(step)
            with open(tmp / STATE, "wb") as fh:  # an open file: a full disk surfaces as the OSError behind torch's RuntimeError
                torch.save(state, fh)
            faults.during_checkpoint_write(step)
            (tmp / "config.resolved.yaml").write_text(config_yaml, encoding="utf-8")
            if extra is not None:
                extra(tmp)
            (tmp / "trainer_state.json").write_text(json.dumps({"step": step, "metric": metric, **labels, "run_id": self.run_id, **info}, indent=2, default=str), encoding="utf-8")
            files = {}
            for f in sorted(tmp.iterdir()):
                _fsync_file(f)
                files[f.name] = {"size": f.stat().st_size, "sha256": file_sha256(f)}
            faults.during_checkpoint_write(step)
            manifest = {"step": step, "metric": metric, **labels, "run_id": self.run_id, "time": time.time(), "files": files}
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2), encoding="utf-8")
            _fsync_file(tmp / MANIFEST)
            _fsync_dir(tmp)
            if final.exists():  # a stale or corrupted checkpoint of the same step
                if self.run_id is not None and not self.owns(CheckpointInfo(final, step, None, _manifest_run_id(final))):
                    raise OSError(17, f"{final} belongs to another run (its manifest names another run id); it is left as it is")
                shutil.rmtree(final)
            os.rename(tmp, final)
            _fsync_dir(self.root)
        except Exception as exc:  # OSError, or torch's RuntimeError / safetensors' SafetensorError around one
            shutil.rmtree(tmp, ignore_errors=True)
            drop_manifest_tmp(self.root.parent)
            err = write_error(exc, self.root)
            if err is None:
                raise
            raise CheckpointWriteError(err.errno, f"could not write checkpoint step-{step}: {err.strerror or err}") from exc
        self._seal()
        return CheckpointInfo(final, step, metric, self.run_id, **{k: labels.get(k) for k in ("metric_name", "metric_value", "eval_loss")})

    def rotate(self) -> list[Path]:
        """Delete all but the newest ``keep_last`` and the best ``keep_best`` of this run's own; return what was deleted."""
        infos = self.all()
        keep = {c.step for c in infos[-self.keep_last :]} if self.keep_last > 0 else set()
        scored = sorted((c for c in infos if c.metric is not None), key=lambda c: (c.metric, c.step))
        keep |= {c.step for c in scored[: self.keep_best]}
        removed = []
        for c in infos:
            if c.step not in keep:
                _remove_checkpoint(c.path)
                removed.append(c.path)
        for stale in self.root.glob(".tmp-step-*"):  # leftovers of a killed writer (the run folder's lock rules out a live one)
            shutil.rmtree(stale, ignore_errors=True)
        self._seal()
        return removed

    # ----------------------------------------------------------------- the run folder's manifest (ownership.py)
    def _owned(self) -> bool:
        """Whether the run folder keeps a manifest (a run lays one out; a bare folder of a unit test does not)."""

        return (self.root.parent / ownership.MANIFEST).is_file()

    def _intend(self, name: str, shapes: list[str] | None = None) -> None:
        """Register ``checkpoints/<name>`` (or `checkpoints/` itself, new to the manifest) as about to be written, with the
        ``shapes`` (:mod:`trainpipe.pending`) of what may lie under it."""

        if not self._owned():
            return
        top = self.root.parent
        listed = self.root.name in ownership.read_manifest(top)["entries"]
        rel = f"{self.root.name}/{name}" if listed else self.root.name
        ownership.intend(top, rel, shapes={rel: shapes} if shapes and listed else None)

    def _seal(self) -> None:
        """Fingerprint ``checkpoints/`` as it is now (after a save's rename, after a rotation) into the run's manifest. A
        manifest that cannot be rewritten (a full disk) leaves the checkpoint complete and its entry pending: still
        provably the run's; the run's own seal at its end tries again."""

        if self._owned() and self.root.is_dir():
            try:  # only checkpoint files (listed by their checkpoint's manifest) and writer temporaries: a person's notes stay foreign
                ownership.record(self.root, accept=lambda rel: _checkpoint_file(self.root, rel))
            except OSError:
                drop_manifest_tmp(self.root.parent)

    # ----------------------------------------------------------------- reading
    @staticmethod
    def load(path: Path) -> tuple[dict, dict]:
        import torch
        from safetensors.torch import load_file

        reason = verify(path)
        if reason:
            raise CheckpointWriteError(0, f"checkpoint {path} is not usable: {reason}")
        name = WEIGHTS
        try:
            weights = load_file(str(path / WEIGHTS))
            name = STATE
            state = torch.load(path / STATE, weights_only=True, map_location="cpu")
        except Exception as exc:  # a hostile or damaged file: safetensors' header checks, torch's weights-only unpickler
            if isinstance(exc, OSError):
                raise
            raise CheckpointUnreadable(path / name, exc) from None
        return weights, state


def _checkpoint_file(root: Path, rel: str) -> bool:
    """Whether ``rel`` (below ``root``, `checkpoints/`) is a checkpoint's file (its manifest lists it with its size) or a
    writer's temporary."""
    parts = rel.split("/")
    if pending.temp_name(parts[0]):
        return True
    return len(parts) == 2 and bool(_NAME.match(parts[0])) and pending.listed(root / parts[0], parts[1], content=False)


def _remove_checkpoint(path: Path) -> list[str]:
    """Delete checkpoint ``path``: the files its own manifest lists (name and size), then the manifest, then the folder
    when nothing else is in it. Anything else (a person's `NOTES.md`) stays, and so does the folder; returns those names."""
    try:
        files = json.loads((path / MANIFEST).read_text(encoding="utf-8")).get("files") or {}
    except (OSError, ValueError, AttributeError):
        files = {}
    for name in files:
        if isinstance(name, str) and "/" not in name and name != MANIFEST and pending.listed(path, name, content=False):
            (path / name).unlink()
    if files:
        (path / MANIFEST).unlink(missing_ok=True)
    left = sorted(p.name for p in path.iterdir()) if path.is_dir() else []
    if not left:
        path.rmdir()
    return left


# --------------------------------------------------------------------------------- files other tools open

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
MODEL_FILES = ("config.json", "model.safetensors")


def interop_writer(model, weights: dict, *, sharded: bool = False, warn=None):
    """A callable that writes, into a checkpoint folder, the files PEFT and transformers load it from; None when there is
    nothing to write (a model that is not a transformers model; a partly trained model sharded by FSDP, whose frozen weights
    no process holds whole). Under PEFT: ``adapter_config.json`` + ``adapter_model.safetensors`` (the adapter's own
    weights, from ``weights``). Otherwise ``config.json`` + ``model.safetensors``: a hard link to the checkpoint's weights
    when every weight trains, else the model's full state as ``save_pretrained`` writes it. A failure that is not a
    write error (an architecture PEFT or transformers cannot save) leaves the checkpoint without these files and calls
    ``warn(text)``; training and resume do not depend on them."""
    from peft import PeftModel
    from transformers import PreTrainedModel

    if isinstance(model, PeftModel):
        def write(folder: Path) -> None:
            from peft.utils import get_peft_model_state_dict
            from safetensors.torch import save_file

            name = model.active_adapter if isinstance(model.active_adapter, str) else model.active_adapters[0]
            sd = get_peft_model_state_dict(model, state_dict=dict(weights), adapter_name=name, save_embedding_layers=False)
            save_file({k: v.detach().contiguous() for k, v in sd.items()}, str(folder / ADAPTER_FILES[1]), metadata={"format": "pt"})
            model.peft_config[name].save_pretrained(str(folder))

        return _guarded(write, ADAPTER_FILES, warn)
    if not isinstance(model, PreTrainedModel):
        return None
    every = set(weights) >= {n for n, _ in model.named_parameters()}
    if not every and sharded:
        return None

    def write_full(folder: Path) -> None:
        if every:
            model.config.to_json_file(str(folder / MODEL_FILES[0]))
            try:
                os.link(folder / WEIGHTS, folder / MODEL_FILES[1])  # the same bytes: no second copy on disk
            except OSError:
                shutil.copyfile(folder / WEIGHTS, folder / MODEL_FILES[1])
        else:  # `freeze`: the frozen weights too, so that the folder is a whole model
            model.save_pretrained(str(folder), safe_serialization=True)

    return _guarded(write_full, MODEL_FILES + ("generation_config.json",), warn)


def _guarded(write, names: tuple[str, ...], warn):
    def run(folder: Path) -> None:
        try:
            write(folder)
        except OSError:
            raise  # a full disk: the checkpoint write fails as a whole (CheckpointWriteError)
        except Exception as exc:  # noqa: BLE001 - the interop files are an extra; the checkpoint itself stays complete
            for f in list(folder.iterdir()):
                if f.name in names or f.name.startswith("model-") or f.name == "model.safetensors.index.json":
                    f.unlink()
            if warn is not None:
                warn(f"the checkpoint holds no {' / '.join(names[:2])} for other tools ({type(exc).__name__}: {str(exc)[:160]}); "
                     "trainpipe resumes and exports from it as usual")

    return run
