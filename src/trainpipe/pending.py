"""What a pending entry of a folder's manifest may hold: the proof an interrupted writer leaves (issue 36).

A writer registers a name before it writes (``ownership.intend``); a kill before it fingerprints what it wrote leaves
that name *pending*. A pending name is not a licence: what lies under it must still look like what that writer could
have produced, or it is foreign and refused by name (``--overwrite`` and ``training.resume=auto`` never delete it):

- a **temporary name** of trainpipe's writers anywhere on the path (``.NAME.tmp-PID-HEX`` of an atomic write,
  ``.tmp-step-N-PID`` of a checkpoint, ``NAME.tmp`` of a model being saved): everything below it is the writer's;
- a file matching the **shape** the writer declared with its name (``base``: the files ``save_pretrained`` writes;
  ``tensorboard``: ``events.out.tfevents.*``; ``checkpoints``: files a checkpoint's own ``manifest.json`` lists with
  their size and SHA-256), unless the writer noted the very files it renames in (then only those);
- a file whose content is the **expected** one (``ownership.write_bytes`` notes the size and SHA-256 of what it is about
  to rename into a pending name; an export notes every file of its finished temporary folder, :func:`tree`);
- a ``*.jsonl`` log whose every complete line is a JSON object (what an append-only log writer leaves);
- a file that a **nested folder's own manifest** proves (a stage's or adapter's run folder).

A leaf module: it imports nothing from trainpipe.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import re
from collections.abc import Callable
from pathlib import Path

# trainpipe's temporary names: ownership.write_bytes / replace_dir (`.NAME.tmp-PID-HEX`, `.NAME.old-PID-HEX`), checkpoints
# (`.tmp-step-N-PID`), the data cache (`KEY.tmp-PID-HOST-HEX`), the store (`NAME.tmp-HEX`), a model saved as `model.tmp`
_TEMP = re.compile(r"^(\.tmp-step-\d+-\d+|(model|base)\.tmp|.+\.(tmp|old)-[A-Za-z0-9._\-]+)$")
LISTED = "@listed"  # a shape entry: a file its folder's checkpoint `manifest.json` lists with this size and SHA-256
MAX_JSONL_CHECK = 64 << 20  # a pending log larger than this is not read through: refused unless fingerprinted
BIG, SAMPLE = 64 << 20, 1 << 20  # a noted file over BIG is known by its size and its first and last SAMPLE bytes (ownership.py)

# the files `save_pretrained` (model, tokenizer, adapter, generation config, chat template, model card) writes
_HF_FILES = ("*.safetensors", "*.safetensors.index.json", "*.json", "*.txt", "*.model", "*.jinja", "*.tiktoken", "README.md",
             "vocab.*", "merges.txt", "*.gguf", "Modelfile")
# a model folder: those files, an export's `.trainpipe-export` marker, and one folder below (`adapter/`) of the same files
MODEL_FILES = (*_HF_FILES, ".trainpipe-export", *(f"*/{g}" for g in _HF_FILES))
# what the writer of each name at the top of a run folder writes below it (rundir.begin registers them with these). `model`
# and `export/NAME` have no shape: their writer (export.py `export_folder`) notes every file it renames in (:func:`tree`),
# so a `model/notes.txt` of a person's is not taken for a file `save_pretrained` could have written
RUN_SHAPES = {
    "base": MODEL_FILES,
    "checkpoints": ("step-*/" + LISTED,),
    "tensorboard": ("events.out.tfevents.*", "*/events.out.tfevents.*"),
    "wandb": ("offline-run-*/**", "run-*/**", "latest-run", "debug.log", "debug-internal.log"),
    "data": ("report.json", "rejected.jsonl", "duplicates.jsonl"),
}


def temp_name(name: str) -> bool:
    """Whether ``name`` (one path component) is a temporary name of a trainpipe writer."""
    return bool(_TEMP.match(name))


def shape_matches(folder: Path, rel: str, shapes: list[str]) -> bool:
    """Whether ``rel`` (a file below a pending path, relative to it) fits one of ``shapes``: globs over the relative path
    (``*`` does not cross `/`), or :data:`LISTED` (listed with its content by its folder's `manifest.json`)."""
    for shape in shapes:
        if shape.endswith(LISTED):
            prefix = shape[: -len(LISTED)]
            parent, _, name = rel.rpartition("/")
            if not prefix and not parent and listed(folder, name):  # a pending checkpoint folder itself (`checkpoints/step-N`)
                return True
            if parent and fnmatch.fnmatchcase(parent + "/", prefix) and listed(folder / parent, name):
                return True
        elif _glob(rel, shape):
            return True
    return False


def _glob(rel: str, pattern: str) -> bool:
    """``*`` within one component; a last component ``**`` takes any path below."""
    a, b = rel.split("/"), pattern.split("/")
    if b[-1] == "**":
        return len(a) >= len(b) and all(fnmatch.fnmatchcase(x, y) for x, y in zip(a, b[:-1]))
    return len(a) == len(b) and all(fnmatch.fnmatchcase(x, y) for x, y in zip(a, b))


def listed(folder: Path, name: str, *, content: bool = True) -> bool:
    """Whether checkpoint folder ``folder``'s `manifest.json` lists ``name`` with its current size and (``content``)
    SHA-256; the manifest itself counts when it lists files."""
    try:
        files = json.loads((folder / "manifest.json").read_text(encoding="utf-8")).get("files")
    except (OSError, ValueError, AttributeError):
        return False
    if not isinstance(files, dict):
        return False
    if name == "manifest.json":
        return True
    fp = files.get(name)
    p = folder / name
    if not isinstance(fp, dict) or p.is_symlink() or not p.is_file() or p.stat().st_size != fp.get("size"):
        return False
    return not content or sha256(p) == fp.get("sha256")


def sha256(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def json_lines(p: Path) -> bool:
    """Whether every complete line of ``p`` is a JSON object (a last line cut by the kill aside): what trainpipe's
    append-only logs hold."""
    try:
        if p.is_symlink() or not p.is_file() or p.stat().st_size > MAX_JSONL_CHECK:
            return False
        lines = p.read_bytes().split(b"\n")
    except OSError:
        return False
    for line in lines[:-1]:
        try:
            if not isinstance(json.loads(line), dict):
                return False
        except ValueError:
            return False
    return True


_ATOMIC = re.compile(r"^\.(.+)\.tmp-\d+-[0-9a-f]{6}$")  # ownership.write_bytes' temporary of NAME


def proves(folder: Path, rel: str, data: dict, nested: Callable[[Path, list[str]], bool]) -> bool:
    """Whether the file ``folder/rel`` is what the interrupted writer of a pending entry of ``data`` (the folder's
    manifest) could have left: a temporary name of its, the shape it declared, the content it was renaming in, an
    append-only log, or (``nested(folder, parts)``) a file the manifest of a run folder nested below proves."""
    parts = rel.split("/")
    temp = _ATOMIC.match(parts[0])
    if temp and (temp.group(1) in data["pending"] or temp.group(1) in data["entries"]):
        return True  # the atomic write of a name this folder expects
    pend = [p for p in data["pending"] if rel == p or rel.startswith(p + "/")]
    if not pend:
        return False
    if any(temp_name(x) for x in parts):
        return True
    path = folder / rel
    if _is_expected(path, data.get("expect", {}).get(rel)):  # the content a writer noted before renaming it in
        return True
    for p in pend:
        below = rel[len(p) + 1:]
        declared = any(k.startswith(p + "/") for k in data.get("expect", {}))  # the writer listed its files: the shape adds none
        if below and not declared and shape_matches(folder / p, below, data.get("shapes", {}).get(p, [])):
            return True
        if not below and rel.endswith(".jsonl") and json_lines(path):
            return True
    return nested(folder, parts)


def _is_expected(path: Path, exp) -> bool:
    fps = exp if isinstance(exp, list) else [exp] if exp else []
    if not fps or path.is_symlink() or not path.is_file():
        return False
    fps = [e for e in fps if e.get("size") == path.stat().st_size]
    return any((sampled_sha256(path) if e.get("sampled") else sha256(path)) == e.get("sha256") for e in fps)


def sampled_sha256(p: Path) -> str:
    """The SHA-256 of a file, or over 64 MiB of its size and first and last MiB (as ownership.py fingerprints big files:
    noting a multi-GB export stays cheap)."""
    size = p.stat().st_size
    if size <= BIG:
        return sha256(p)
    h = hashlib.sha256()
    with open(p, "rb") as fh:
        h.update(fh.read(SAMPLE))
        fh.seek(size - SAMPLE)
        h.update(fh.read(SAMPLE))
    h.update(str(size).encode())
    return h.hexdigest()


def noted(old: dict, new: dict) -> dict:
    """The expected contents once a writer notes ``new`` ({rel: {size, sha256}}): a file noted again (rewritten in place, as
    the model card gets its gates line) keeps its last few contents, since a kill may land before or after the rename."""
    out = dict(old)
    for rel, fp in new.items():
        prev = out.get(rel)
        prev = prev if isinstance(prev, list) else [prev] if prev else []
        out[rel] = [*(x for x in prev if x != fp), fp][-4:]
    return out


def tree(folder: Path, rel: str) -> dict[str, dict]:
    """``{rel/FILE: {size, sha256}}`` for every file below ``folder`` (a writer's finished temporary folder, about to be
    renamed to ``rel``): what the writer produced, noted before the rename so that only those files are proven under it."""
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file() and not p.is_symlink():
            size = p.stat().st_size
            out[f"{rel}/{p.relative_to(folder).as_posix()}"] = {"size": size, "sha256": sampled_sha256(p), **({"sampled": True} if size > BIG else {})}
    return out


def appended(folder: Path, entries: dict) -> list[tuple[str, int]]:
    """The append-only logs among ``entries`` (a manifest's, ``*.jsonl``/``*.log`` at the top of ``folder``) that grew
    since trainpipe last fingerprinted them, with how many lines were added: what clearing the folder deletes unseen."""
    out = []
    for name, fp in entries.items():
        p = folder / name
        if isinstance(fp, dict) and fp.get("grows") and p.is_file() and not p.is_symlink() and p.stat().st_size > fp.get("size", 0):
            with open(p, "rb") as fh:
                fh.seek(fp.get("size", 0))
                out.append((name, fh.read().count(b"\n")))
    return out


def unsealable(folder: Path, unproven: list[str], data: dict, since: float | None) -> set[str]:
    """Of ``unproven`` (``ownership.foreign``), what a seal must leave out: what lies under a listed or pending name of
    ``data`` (the manifest) and did not change since ``since`` (inode change time, which no one can set back)."""
    def claimed(b: str) -> bool:
        return b.split("/")[0] in data["entries"] or any(b == x or b.startswith(x + "/") or x.startswith(b + "/") for x in data["pending"])

    return {b for b in unproven if claimed(b) and (since is None or (folder / b).lstat().st_ctime < since)}
