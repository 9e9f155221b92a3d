"""Reading sources into records, streamed, with where each record came from.

A source is a file (JSONL, JSON, Parquet, CSV/TSV, TXT; the text formats also gzip-, bzip2-, xz- or, with the
`zstandard` package, zstd-compressed: `train.jsonl.gz`), a glob or folder of such files,
a folder written by ``datasets.save_to_disk``, a hub dataset id, or a SQL query. Every
reader is a generator: nothing is loaded whole into memory (Parquet is read by row group,
Arrow folders are memory-mapped, SQL rows are streamed from the cursor).

Every item is either a :class:`Record` or a :class:`Rejected` with a reason; the
``line`` of a record is its line number (JSONL, CSV, TXT; of the decompressed text for a compressed file) or its
1-based row / item index (``unit`` says which), so an error can always name where the record is. A UTF-8 byte-order
mark at the start of a text file is not part of its first record.

The readers are in data/readers.py (files; data/files.py opens and decompresses them) and data/remote.py (hub,
SQL); :class:`Record`, :class:`Rejected` and :class:`Limits` in data/records.py. Their public names are importable
from here too.

Records are bounded (:class:`Limits`): a JSONL line longer than ``data.max_record_bytes`` is measured while it is
read, in 1 MiB pieces, and never held, parsed or tokenized whole; a record of any other reader whose text is longer
is dropped before anything else looks at it. Both are ``too_big`` drops. A record nested deeper than
:data:`MAX_DEPTH` lists/objects is ``too_deep`` (Python's parser would otherwise raise RecursionError, and every
later stage walks records recursively).
"""

from __future__ import annotations

import glob as _glob
from pathlib import Path
from typing import Iterator

from trainpipe.data.files import COMPRESSIONS, FILE_SUFFIXES, OTHER_COMPRESSIONS, compression_of, file_kind, is_data_file, sha256_path, sniff_compression
from trainpipe.data.readers import read_arrow_dir, read_csv, read_json, read_jsonl, read_parquet, read_txt
from trainpipe.data.records import DEFAULT_RECORD_BYTES, MAX_DEPTH, Limits, Record, Rejected, bounded, default_record_bytes, excerpt
from trainpipe.data.remote import check_select, read_hub, read_sql, readonly_engine
from trainpipe.errors import DataError
from trainpipe.redact import redact_url

__all__ = [
    "COMPRESSIONS", "DEFAULT_RECORD_BYTES", "FILE_SUFFIXES", "MAX_DEPTH", "OTHER_COMPRESSIONS", "Limits", "Record", "Rejected",
    "check_select", "check_sources", "compression_of", "default_record_bytes", "describe", "excerpt", "expand", "file_kind",
    "fingerprint", "is_data_file", "iter_source", "read_arrow_dir", "read_csv", "read_file", "read_hub", "read_json", "read_jsonl",
    "read_parquet", "read_sql", "read_txt", "readonly_engine", "sha256_path", "sniff_compression",
]


def _is_arrow_dir(p: Path) -> bool:
    return p.is_dir() and ((p / "dataset_info.json").exists() or (p / "state.json").exists() or (p / "dataset_dict.json").exists())


def expand(path: str) -> list[Path]:
    """The files (or one save_to_disk folder) a ``path`` names: a file, a glob, or a folder of data files."""
    p = Path(path)
    if any(ch in path for ch in "*?["):
        files = sorted(Path(x) for x in _glob.glob(path, recursive=True) if is_data_file(Path(x)) and Path(x).is_file())
        if not files:
            raise DataError(f"The glob `{path}` matches no data file ({', '.join(sorted(FILE_SUFFIXES))}, plain or .gz/.bz2/.xz/.zst). Check the pattern and the folder.")
        return files
    if _is_arrow_dir(p):
        return [p]
    if p.is_dir():
        files = sorted(x for x in p.rglob("*") if x.is_file() and is_data_file(x))
        if not files:
            raise DataError(f"The folder `{p}` holds no data file ({', '.join(sorted(FILE_SUFFIXES))}, plain or .gz/.bz2/.xz/.zst) and is not a `datasets.save_to_disk` folder.")
        return files
    if not p.exists():
        raise DataError(f"Data file `{p}` does not exist: check `data.sources[].path` (relative paths are resolved against the config file's folder).")
    return [p]


def check_sources(sources) -> None:
    """Fail fast (before a run directory is written) when a file source names nothing readable or a SQL query is not
    one read-only SELECT. Hub sources and SQL connections are checked when they are read."""
    for i, src in enumerate(sources):
        if src.sql is not None:
            try:
                check_select(src.sql.query)
            except DataError as exc:
                raise DataError(f"`data.sources[{i}].sql.query`: {exc.message}") from None
        if src.path is None:
            continue
        try:
            expand(src.path)
        except DataError as exc:
            raise DataError(f"`data.sources[{i}].path`: {exc.message}") from None


def describe(src) -> str:
    if src.path is not None:
        return src.path
    if src.hub is not None:
        return f"hub:{src.hub}"
    return f"sql:{redact_url(src.sql.url)}"  # a label others print and store: never the password


def fingerprint(src) -> dict:
    """Content identity of a source for the cache key: SHA-256 of every file, or the id / query."""
    if src.path is not None:
        files = []
        for f in expand(src.path):
            files.append({"path": str(f), "sha256": sha256_path(f)})
        return {"kind": "files", "files": files}
    if src.hub is not None:
        return {"kind": "hub", "id": src.hub, "config": src.hub_config, "split": src.hub_split, "revision": src.hub_revision}
    return {"kind": "sql", "url": src.sql.url, "query": src.sql.query}


def iter_source(src, digests: dict | None = None, limits: Limits | None = None) -> Iterator[Record | Rejected]:
    """Every record of one configured source, in order. ``digests`` (when given) receives, per file read,
    ``{"sha256": ..., "exact": bool}``: the hash of the bytes the records came from (``exact``), or, for Parquet
    and Arrow folders (read by random access), the file's hash once reading ended. ``limits``: see :class:`Limits`."""
    if src.hub is not None:
        yield from bounded(read_hub(src.hub, src.hub_config, src.hub_split, src.hub_revision), limits)
        return
    if src.sql is not None:
        yield from bounded(read_sql(src.sql.url, src.sql.query), limits)
        return
    for f in expand(src.path):
        yield from read_file(f, split=src.hub_split, digests=digests, limits=limits, split_by=getattr(src, "split_by", "auto"))


def read_file(p: Path, split: str = "train", digests: dict | None = None, limits: Limits | None = None,
              split_by: str = "auto") -> Iterator[Record | Rejected]:
    if _is_arrow_dir(p):
        yield from bounded(read_arrow_dir(p, split), limits)
        if digests is not None:
            digests[str(p)] = {"sha256": sha256_path(p), "exact": False}
        return
    kind = file_kind(p)[0] or "jsonl"
    if p.stat().st_size == 0:
        raise DataError(f"Data file `{p}` is empty (0 bytes). Fill it, or remove it from `data.sources`.")
    if kind == "jsonl":  # measured line by line before parsing
        yield from read_jsonl(p, digests=digests, limits=limits)
        return
    if kind in ("csv", "tsv"):  # a field over the cap is dropped by the csv parser itself (it never builds it)
        yield from bounded(read_csv(p, digests=digests, max_field=limits.max_record_bytes if limits else None), limits)
        return
    if kind == "txt":
        yield from bounded(read_txt(p, digests=digests, split_by=split_by), limits)
        return
    reader = {"json": read_json, "parquet": read_parquet}[kind]
    yield from bounded(reader(p, digests=digests), limits)
