"""The content-addressed step cache of `trainpipe pipeline run`.

A step's key is the SHA-256 of three parts: its inputs' content (the digests of the artefacts it consumes, files hashed
byte for byte), its config section (canonical JSON of the keys the step reads), and its code (the trainpipe version and
the SHA-256 of the source files of the modules that run it). The same key means the same result; a step whose key has an
entry is reused, not run.

An entry lives at `cache/<step>/<key>.json` in the artefact store (store.py), beside its outputs under
`artifacts/<step>/<key>/`. It records each output's files with their SHA-256, the key's parts, and the lineage (what
produced it), and it carries its own checksum. It is written last, so a step that failed half way leaves no entry; an
entry whose checksum or whose files do not verify is ignored with a warning and the step runs again.

Verifying a file reads it only when its stat (size, mtime, ctime, inode, device) is not the one the store's digest
cache recorded when it was written or last hashed (digests.py): an unchanged multi-GB entry verifies in milliseconds,
and any write to a stored file makes it read and compared again. A change that leaves the stat as it was (bit rot, a
write below the file system) is caught only by a full re-hash: `trainpipe cache verify` (`lookup(..., full=True)`).
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import trainpipe
from trainpipe import ownership
from trainpipe.pipeline.store import ArtifactStore, digest_of, sha256_bytes

_SRC = Path(trainpipe.__file__).parent


def canonical(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()


def code_hash(modules: tuple[str, ...]) -> str:
    """trainpipe's version and the SHA-256 of the source of `modules` (package-relative files or folders, e.g.
    `data`, `train/loop.py`)."""
    h = hashlib.sha256(f"trainpipe {trainpipe.__version__}\n".encode())
    for m in sorted(modules):
        p = _SRC / m
        files = sorted(p.rglob("*.py")) if p.is_dir() else [p]
        for f in files:
            if f.is_file():
                h.update(f.relative_to(_SRC).as_posix().encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def step_key(step: str, inputs: dict[str, str], config: dict, code: str) -> tuple[str, dict]:
    parts = {"step": step, "inputs": dict(sorted(inputs.items())), "config": sha256_bytes(canonical(config)), "code": code}
    return sha256_bytes(canonical(parts)), parts


@dataclass
class Lookup:
    entry: dict | None
    warning: str | None = None


class StepCache:
    def __init__(self, store: ArtifactStore):
        self.store = store

    @staticmethod
    def entry_key(step: str, key: str) -> str:
        return f"cache/{step}/{key}.json"

    @staticmethod
    def artifact_key(step: str, key: str, name: str) -> str:
        return f"artifacts/{step}/{key}/{name}"

    def lookup(self, step: str, key: str, *, full: bool = False) -> Lookup:
        """The entry of (step, key) when its checksum and every file of its outputs verify; else None (with a warning
        when an entry was there but failed). `full`: every file read, not trusted by its stat."""
        ek = self.entry_key(step, key)
        if not self.store.exists(ek):
            return Lookup(None)
        try:
            entry = json.loads(self.store.get_bytes(ek))
        except ValueError:
            return Lookup(None, f"cache entry {self.store.uri(ek)} is not valid JSON; ignored, the step runs again")
        body = {k: v for k, v in entry.items() if k != "checksum"}
        if entry.get("checksum") != sha256_bytes(canonical(body)) or entry.get("key") != key:
            return Lookup(None, f"cache entry {self.store.uri(ek)} fails its checksum; ignored, the step runs again")
        for name, out in entry.get("outputs", {}).items():
            for rel, sha in out.get("files", {}).items():
                fk = f"{out['key']}/{rel}" if rel else out["key"]
                try:
                    got = self.store.file_sha256(fk, full=full)
                except (FileNotFoundError, OSError):
                    return Lookup(None, f"cache entry {step}/{key[:12]}: output `{name}` file {rel or out['key']} is missing; ignored, the step runs again")
                if got != sha:
                    return Lookup(None, f"cache entry {step}/{key[:12]}: output `{name}` file {rel or out['key']} has sha256 {got[:12]}, the entry recorded "
                                        f"{sha[:12]}; ignored, the step runs again")
        if self.store.local:
            self.store.digests.flush()
        return Lookup(entry)

    def verify(self, *, remove: bool = True) -> list[dict]:
        """Re-hash every file of every entry in full (`trainpipe cache verify`); an entry that fails is removed with
        its artefacts when `remove` (the next run rebuilds it). Returns [{step, key, ok, problem}]."""
        out = []
        written = dict(self.store.digests.entries) if self.store.local else None  # the stats trainpipe hashed, before the re-hash
        for e in self.entries():
            look = self.lookup(e["step"], e["key"], full=True)
            ok = look.entry is not None
            out.append({"step": e["step"], "key": e["key"], "ok": ok, "problem": look.warning})
            if not ok and remove:
                self._drop(e, dry_run=False, everything_proven=True, written=written)
        if self.store.local:
            self.store.digests.flush()
        return out

    def save(self, step: str, key: str, parts: dict, outputs: dict[str, Path], *, types: dict[str, str], lineage: dict, seconds: float,
             exclude: tuple[str, ...] = ()) -> dict:
        """Upload `outputs` (name -> local file or folder) and write the entry last. Where the output's usual key holds
        something the ownership rule does not prove trainpipe's (an earlier copy changed since it was written: the entry
        that listed it failed verification), the rebuilt output goes beside it under a new name, and the changed copy is
        left as it is (`cache gc` reports it, never deletes it)."""
        recorded = {}
        for name, local in outputs.items():
            ak = self.artifact_key(step, key, name)
            if not self.store.replaceable(ak):
                ak = f"{ak}.rebuilt-{uuid.uuid4().hex[:8]}"
            files = self.store.put_path(Path(local), ak, exclude=exclude)
            recorded[name] = {"key": ak, "uri": self.store.uri(ak), "type": types.get(name), "files": files, "digest": digest_of(files),
                              "kind": "file" if list(files) == [""] else "folder"}
        body = {"step": step, "key": key, "parts": parts, "outputs": recorded, "lineage": lineage, "created": time.time(), "seconds": round(seconds, 3),
                "trainpipe_version": trainpipe.__version__}
        entry = body | {"checksum": sha256_bytes(canonical(json.loads(canonical(body))))}
        self.store.put_bytes(self.entry_key(step, key), canonical(entry))
        return entry

    def entries(self) -> list[dict]:
        """The store's index: every cache entry (a JSON file under `cache/<step>/` with its step, key and outputs)."""
        out = []
        for step_dir in self.store.ls("cache"):
            for k in self.store.ls(step_dir):
                if not k.endswith(".json"):
                    continue
                e = self.store.get_json(k)
                if not (isinstance(e, dict) and isinstance(e.get("step"), str) and isinstance(e.get("key"), str) and isinstance(e.get("outputs"), dict)
                        and k == self.entry_key(e["step"], e["key"])):
                    continue  # not a cache entry (nothing trainpipe lists, nothing gc touches)
                size = sum(sum(self.store.walk_files(o["key"]).values()) for o in e["outputs"].values() if isinstance(o, dict) and "key" in o)
                out.append(e | {"_size": size, "_entry": k})
        return sorted(out, key=lambda e: e.get("created", 0))

    def _entry_is_ours(self, e: dict) -> bool:
        body = {k: v for k, v in e.items() if k != "checksum" and not k.startswith("_")}
        return e.get("checksum") == sha256_bytes(canonical(body)) or self.store.owned(e["_entry"])

    def _drop(self, e: dict, *, dry_run: bool, everything_proven: bool = False, written: dict | None = None) -> tuple[list[str], list[str]]:
        """Remove what entry `e` lists (its outputs' files whose content still matches the entry), then the entry itself
        (when its own checksum verifies, or the ownership manifest proves it). `everything_proven` (cache verify, whose
        entry failed): an output folder the ownership manifest proves trainpipe's (unchanged since written) goes whole."""
        removed: list[str] = []
        kept: list[str] = []
        for name, o in e["outputs"].items():
            if not (isinstance(o, dict) and isinstance(o.get("key"), str) and isinstance(o.get("files"), dict)):
                continue
            if not o["key"].startswith(f"artifacts/{e['step']}/{e['key']}/") or ".." in o["key"].split("/"):
                continue  # an entry never lists anything outside its own artefact folder
            if everything_proven and self.store.owned(o["key"]):
                removed.append(o["key"])
                if not dry_run:
                    self.store.rm(o["key"])
                continue
            r, k = self.store.remove_listed(o["key"], o["files"], dry_run=dry_run, written=written)
            removed += r
            kept += k
        if self._entry_is_ours(e):
            removed.append(e["_entry"])
            if not dry_run:
                p = self.store.path(e["_entry"])
                if self.store.local:
                    if Path(p).is_file() and not Path(p).is_symlink():
                        Path(p).unlink()
                        ownership.forget(Path(p).parent, Path(p).name)
                        self.store._prune(p.rsplit("/", 1)[0])
                else:
                    self.store.fs.rm(p)
        else:
            kept.append(e["_entry"])
        return removed, kept

    def gc(self, *, keep: set[tuple[str, str]], dry_run: bool = False) -> list[str]:
        """Remove every entry not in `keep` ((step, key) pairs the pipelines' latest runs use) with the files it lists
        (those whose content still matches the entry), artefacts without an entry and temporaries left by an interrupted
        write when the ownership manifest proves them trainpipe's (a local store). Nothing else in the store is touched:
        a file added or changed there by anyone else stays (listed in `self.kept`). Returns what was removed (or, with
        `dry_run`, what would be)."""
        removed: list[str] = []
        self.kept: list[str] = []
        entries = self.entries()
        indexed = {(e["step"], e["key"]) for e in entries}
        for e in entries:
            if (e["step"], e["key"]) in keep:
                continue
            r, k = self._drop(e, dry_run=dry_run)
            removed += r
            self.kept += k
        for step_dir in self.store.ls("artifacts"):
            step = step_dir.rsplit("/", 1)[-1]
            for k in self.store.ls(step_dir):
                if not self.store.fs.isdir(self.store.path(k)):
                    continue
                for item in self.store.ls(k):
                    if (step, k.rsplit("/", 1)[-1]) in indexed and ".tmp-" not in item.rsplit("/", 1)[-1]:
                        continue  # an entry's output: removed above with its entry, or kept with it
                    if self.store.owned(item):  # an output written with no entry after it (interrupted), or a temporary
                        removed.append(item)
                        if not dry_run:
                            self.store.rm(item)
        for step_dir in self.store.ls("cache"):
            for k in self.store.ls(step_dir):
                if ".tmp-" in k.rsplit("/", 1)[-1] and self.store.owned(k):
                    removed.append(k)
                    if not dry_run:
                        self.store.rm(k)
        return sorted(set(removed))
