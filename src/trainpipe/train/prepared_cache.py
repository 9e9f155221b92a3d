"""The prepared-data cache of the table and image families: one data step per content, whichever command asks.

`trainpipe run`, every arm of `trainpipe automl` and AutoGluon's `automl --task tabular` call the family's data step
(train/family.py `Family.prepare`) through :func:`cached`. The key is the SHA-256 of what the data step reads and nothing
else: the family, the task, `training.seed` (the split's seed), the whole `data:` section (less `cache_dir`, where the
cache lives, and `packing`, text batching the planner resolves) and the content hash of every source (a file's SHA-256; a folder's over every file's relative path and
bytes). The output folder, the command, the model and the training settings are not in it, so the same data through
`trainpipe run` and `trainpipe automl` is prepared once: the second prints `data: cache reused: PATH`.

The entry is one JSON document (`<key>.json` under `data.cache_dir`, else `$TRAINPIPE_CACHE/data/family` or
`~/.cache/trainpipe/data/family`): the splits' examples (image bytes as base64), the data report and the fitted
preprocessing; never a pickle. It is written atomically through the ownership rule and holds the user's data
unredacted, like the text family's Arrow cache (data/cache.py). Not cached: `data.factory` datasets (your code, which
trainpipe cannot hash), SQL and hub sources (their content can change under the same name), and ranks other than 0 of a
distributed run (each computes the same deterministic split, as before). An entry that cannot be read is rebuilt.
"""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import fields
from pathlib import Path
from typing import Callable

from trainpipe import ownership, ui
from trainpipe.config.family import resolve_task
from trainpipe.data.cache import default_dir
from trainpipe.data.files import sha256_path
from trainpipe.data.images import describe
from trainpipe.data.tabular import Preprocessing
from trainpipe.distributed import env as dist_env
from trainpipe.train.supervised import Prepared

CODE_VERSION = "1"  # bump when a family's data step changes what it prepares
# not part of the key: where the cache lives, and the text batching `trainpipe run`'s planner resolves (`packing: auto` ->
# `padding_free`), which tables and images never read: the run's resolved config and the raw one give the same key
IGNORED = {"cache_dir", "packing"}


def cache_key(family: str, cfg) -> str | None:
    """The content key of ``cfg``'s data step for ``family``; None where it cannot be cached (see the module docstring)."""
    data = cfg.data
    if data is None or data.factory is not None:
        return None
    hashes = []
    for src in data.sources:
        if src.path is None or getattr(src, "sql", None) is not None or getattr(src, "hub", None) is not None or not Path(src.path).exists():
            return None
        hashes.append(sha256_path(Path(src.path)))
    section = data.model_dump(mode="json", exclude=IGNORED)
    task = "classification" if family == "image" else resolve_task(cfg.method, cfg.data)[0]
    kind = "image" if family == "image" else "table"  # the tabular and custom families read a table by the same data step
    doc = {"kind": kind, "task": task, "seed": cfg.training.seed, "data": section, "sources": hashes, "version": CODE_VERSION}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:32]


def cache_folder(cfg) -> Path:
    return (Path(cfg.data.cache_dir) if cfg.data.cache_dir else default_dir()) / "family"


def _encode(v):
    if isinstance(v, bytes):
        return {"__b64__": base64.b64encode(v).decode("ascii")}
    if isinstance(v, dict):
        return {k: _encode(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_encode(x) for x in v]
    return v


def _decode(v):
    if isinstance(v, dict):
        if set(v) == {"__b64__"}:
            return base64.b64decode(v["__b64__"])
        return {k: _decode(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_decode(x) for x in v]
    return v


def to_json(p: Prepared) -> bytes:
    doc = {f.name: getattr(p, f.name) for f in fields(p)}
    doc["prep"] = p.prep.to_dict() if p.prep is not None else None
    return json.dumps(_encode(doc), separators=(",", ":")).encode("utf-8")


def from_json(raw: bytes) -> Prepared:
    doc = _decode(json.loads(raw))
    doc["prep"] = Preprocessing.from_dict(doc["prep"]) if doc.get("prep") is not None else None
    return Prepared(**doc)


def cached(family: str, prepare: Callable, cfg) -> Prepared:
    """``prepare(cfg)`` (the family's data step), read from the cache when the same content was prepared before."""
    key = cache_key(family, cfg) if dist_env.is_main() else None
    if key is None:
        return prepare(cfg)
    con = ui.console()
    path = cache_folder(cfg) / f"{key}.json"
    if path.is_file():
        try:
            data = from_json(path.read_bytes())
        except (ValueError, KeyError, TypeError):
            data = None  # unreadable (an older layout, a torn copy): rebuilt below
        if data is not None:
            if family == "image":  # what the data step prints, as the build printed it
                for line in describe(data.report):
                    con.print(f"  {line}", markup=False, soft_wrap=True, highlight=False)
            con.print(f"data: cache reused: {path}", markup=False, soft_wrap=True, highlight=False)
            data.report = {**data.report, "cache": {"hit": True, "path": str(path), "key": key}}
            return data
    data = prepare(cfg)
    ownership.make_dir(path.parent, what="the prepared-data cache folder")
    ownership.write_bytes(path, to_json(data), what="the prepared-data cache (the data step's splits)")  # the user's data, unredacted like the Arrow cache
    con.print(f"data: cache written: {path}", markup=False, soft_wrap=True, highlight=False)
    data.report = {**data.report, "cache": {"hit": False, "path": str(path), "key": key}}
    return data
