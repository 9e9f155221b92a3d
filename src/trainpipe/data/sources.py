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

Records are bounded (:class:`Limits`): a JSONL line longer than ``data.max_record_bytes`` is measured while it is
read, in 1 MiB pieces, and never held, parsed or tokenized whole; a record of any other reader whose text is longer
is dropped before anything else looks at it. Both are ``too_big`` drops. A record nested deeper than
:data:`MAX_DEPTH` lists/objects is ``too_deep`` (Python's parser would otherwise raise RecursionError, and every
later stage walks records recursively).
"""

from __future__ import annotations

import bz2
import csv
import glob as _glob
import gzip
import hashlib
import io
import lzma
import zlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from trainpipe.errors import DataError
from trainpipe.hashing import update_from_file
from trainpipe.redact import redact_url

FILE_SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".tsv": "tsv", ".txt": "txt"}
# Whole-file compressions of the text formats that are read as they are decompressed (stdlib gzip, bz2, lzma; zstd when
# the `zstandard` package is installed). Parquet compresses inside the file (its codec), so `.parquet.gz` is refused.
COMPRESSIONS = {".gz": "gzip", ".gzip": "gzip", ".bz2": "bzip2", ".xz": "xz", ".lzma": "xz", ".zst": "zstd", ".zstd": "zstd"}
# Archives and compressions that are not read: a file named so is refused with what works, never read as text.
OTHER_COMPRESSIONS = {".zip": "zip", ".7z": "7-Zip", ".rar": "RAR", ".lz4": "LZ4", ".br": "Brotli", ".lz": "lzip", ".z": "Unix compress",
                      ".sz": "Snappy", ".snappy": "Snappy", ".tgz": "tar.gz", ".tar": "tar"}
# The first bytes of each compressed format: a compressed file without the suffix is read (or refused) by its content.
_MAGIC = ((b"\x1f\x8b", "gzip"), (b"\xfd7zXZ\x00", "xz"), (b"\x28\xb5\x2f\xfd", "zstd"), (b"PK\x03\x04", "zip"),
          (b"7z\xbc\xaf\x27\x1c", "7-Zip"), (b"\x04\x22\x4d\x18", "LZ4"), (b"Rar!\x1a\x07", "RAR"))
_BOM = "\ufeff"
MAX_DEPTH = 100  # lists/objects inside each other in one record; real records (tool calls, JSON schemas) stay far below
DEFAULT_RECORD_BYTES = 4 << 20


def default_record_bytes(max_length: int) -> int:
    """The rule for ``data.max_record_bytes`` when unset: 4 MiB, or 128 bytes per ``max_length`` token when that is
    more (a token is rarely over 16 characters, a character at most 4 UTF-8 bytes, JSON escapes up to 6, and a
    preference record repeats its prompt): far over any example that fits ``max_length``, far under what hurts."""
    return max(DEFAULT_RECORD_BYTES, 128 * max_length)


@dataclass(frozen=True)
class Limits:
    """Per-record bounds applied while reading (see the module docstring)."""

    max_record_bytes: int | None = None
    max_depth: int = MAX_DEPTH


def file_kind(p: Path) -> tuple[str | None, str | None]:
    """(format kind or None, compression suffix or None) of a file name: `train.jsonl.gz` -> ("jsonl", ".gz")."""
    suffixes = [x.lower() for x in p.suffixes[-2:]]
    if suffixes and (suffixes[-1] in COMPRESSIONS or suffixes[-1] in OTHER_COMPRESSIONS):
        inner = suffixes[-2] if len(suffixes) == 2 else None
        return FILE_SUFFIXES.get(inner) if inner else None, suffixes[-1]
    return FILE_SUFFIXES.get(suffixes[-1]) if suffixes else None, None


def is_data_file(p: Path) -> bool:
    """A file a glob or folder source reads: a data suffix, plain or under a compression suffix (an unreadable
    compression included, so that it is refused with a reason rather than skipped without one)."""
    return file_kind(p)[0] is not None


_WHAT_WORKS = ("JSONL, JSON, CSV, TSV and TXT files plain or compressed as .gz, .bz2, .xz (and .zst with `pip install 'trainpipe[zstd]'`), "
               "Parquet with its own internal compression")


@dataclass
class Record:
    source: str  # file path, hub id or sql url
    line: int  # 1-based line number, row or item index (see ``unit``)
    data: dict
    unit: str = "line"


@dataclass
class Rejected:
    source: str
    line: int
    reason: str
    excerpt: str
    unit: str = "line"
    kind: str = "format_mismatch"  # the counted reason

    def to_dict(self) -> dict:
        return {"source": self.source, "line": self.line, "unit": self.unit, "kind": self.kind, "reason": self.reason, "excerpt": self.excerpt}


def excerpt(text: str, n: int = 80) -> str:
    text = text.rstrip("\n")
    return text if len(text) <= n else text[: n - 3] + "..."


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


def sha256_path(path: Path) -> str:
    h = hashlib.sha256()
    files = [path] if path.is_file() else sorted(x for x in path.rglob("*") if x.is_file())
    for f in files:
        if path.is_dir():
            h.update(str(f.relative_to(path)).encode())
        update_from_file(h, f)
    return h.hexdigest()


class _HashingRaw(io.RawIOBase):
    """A binary file read once, front to back, with the SHA-256 of every byte that went through it: the digest of
    what was read (not of what the file held at some other moment), known at EOF."""

    def __init__(self, fh):
        self._fh = fh
        self.sha = hashlib.sha256()

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = self._fh.readinto(b)
        if n:
            self.sha.update(memoryview(b)[:n])
        return n

    def close(self) -> None:
        self._fh.close()
        super().close()


def _hashed_open(p: Path) -> tuple[io.BufferedReader, _HashingRaw]:
    raw = _HashingRaw(open(p, "rb"))
    return io.BufferedReader(raw, buffer_size=1 << 20), raw


def sniff_compression(p: Path) -> str | None:
    """The compression a file's first bytes show (gzip, bzip2, xz, zstd, zip, ...), or None for plain bytes."""
    with open(p, "rb") as fh:
        head = fh.read(10)
    if head[:3] == b"BZh" and head[3:4].isdigit() and head[4:10] == b"1AY&SY":
        return "bzip2"
    return next((name for magic, name in _MAGIC if head.startswith(magic)), None)


def compression_of(p: Path) -> str | None:
    """How a data file is compressed: its suffix (`.gz`, `.bz2`, `.xz`, `.zst`, ...) or, without one, its first bytes.
    Raises DataError, naming the file and what works, for a compression trainpipe does not read."""
    kind, suffix = file_kind(p)
    name = COMPRESSIONS.get(suffix) or OTHER_COMPRESSIONS.get(suffix) if suffix else sniff_compression(p)
    if name is None:
        return None
    how = f"its name ends in `{suffix}`" if suffix else "its first bytes say so"
    if name in OTHER_COMPRESSIONS.values() or name in ("zip", "7-Zip", "LZ4", "RAR"):
        raise DataError(
            f"`{p}` is {name}-compressed ({how}), which trainpipe does not read. Unpack it (e.g. `unzip`, `7z x`, `lz4 -d`) "
            f"and point `data.sources[].path` at the data file inside, or recompress it with gzip (`gzip -c FILE > FILE.gz`); "
            f"what works: {_WHAT_WORKS}."
        )
    if kind == "parquet" and suffix:
        raise DataError(
            f"`{p}` is a Parquet file inside a {name} file; Parquet compresses its own columns, so write it uncompressed "
            f"with a codec instead (`df.to_parquet(path, compression='zstd')`) or decompress it (`{ {'gzip': 'gunzip', 'bzip2': 'bunzip2', 'xz': 'unxz', 'zstd': 'unzstd'}[name]} {p.name}`)."
        )
    if name == "zstd":
        try:
            import zstandard  # noqa: F401
        except ImportError:
            raise DataError(
                f"`{p}` is zstd-compressed ({how}); reading it needs the `zstandard` package: `pip install 'trainpipe[zstd]'` "
                f"(or decompress it: `unzstd {p.name}`). What works without it: {_WHAT_WORKS}."
            ) from None
    return name


class _ZstdRaw(io.RawIOBase):
    """zstd frames decompressed one after the other; a stream that ends inside a frame is an EOFError (zstandard's
    own stream reader returns what it has and says nothing, which would drop the rest of a truncated file silently)."""

    def __init__(self, fh):
        import zstandard

        self._zstd, self._fh, self._buf, self._inside = zstandard, fh, b"", False
        self._dec = zstandard.ZstdDecompressor().decompressobj()

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while not self._buf:
            chunk = self._fh.read(1 << 16)
            if not chunk:
                if self._inside:
                    raise EOFError("the file ended inside a zstd frame")
                return 0
            while chunk:
                self._inside = True
                self._buf += self._dec.decompress(chunk)
                chunk = b""
                if self._dec.eof:  # a frame ended: the rest (if any) starts the next one
                    chunk, self._inside = self._dec.unused_data, False
                    self._dec = self._zstd.ZstdDecompressor().decompressobj()
        n = min(len(b), len(self._buf))
        b[:n], self._buf = self._buf[:n], self._buf[n:]
        return n


class _Opened:
    """A data file opened for one front-to-back read: ``fh`` yields the (decompressed) bytes, ``hashing`` sees every
    byte of the file as stored (the cache key is the hash of those), ``finish()`` reads what the decompressor left
    (trailing bytes) into the hash and closes everything."""

    def __init__(self, p: Path, compression: str | None):
        self.path, self.compression = p, compression
        self.stored, self.hashing = _hashed_open(p)
        if compression is None:
            self.fh = self.stored
        elif compression == "gzip":
            self.fh = gzip.GzipFile(fileobj=self.stored, mode="rb")
        elif compression == "bzip2":
            self.fh = bz2.BZ2File(self.stored, mode="rb")
        elif compression == "xz":
            self.fh = lzma.LZMAFile(self.stored, mode="rb")
        else:  # zstd (compression_of checked that zstandard imports)
            self.fh = io.BufferedReader(_ZstdRaw(self.stored), buffer_size=1 << 20)

    def __enter__(self) -> "_Opened":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def read_all(self) -> bytes:
        with self.errors():
            return self.fh.read()

    def finish(self) -> str:
        """The SHA-256 of every stored byte (read to the end), once the records are read."""
        while self.stored.read(1 << 20):
            pass
        return self.hashing.sha.hexdigest()

    def close(self) -> None:
        if self.fh is not self.stored:
            self.fh.close()
        self.stored.close()

    def errors(self, where: str = ""):
        return _decompress_errors(self.path, self.compression, where)


class _decompress_errors:
    """A broken compressed stream (truncated, corrupt) is one DataError naming the file and where it broke."""

    def __init__(self, p: Path, compression: str | None, where: str = ""):
        self.p, self.compression, self.where = p, compression, where

    def __enter__(self):
        return self

    def __exit__(self, typ, exc, tb):
        if exc is None or self.compression is None or isinstance(exc, (DataError, UnicodeDecodeError, GeneratorExit)):
            return False
        if isinstance(exc, (EOFError, OSError, lzma.LZMAError, zlib.error)) or type(exc).__name__ == "ZstdError":
            raise DataError(
                f"`{self.p}` is not a complete {self.compression} file{self.where} ({type(exc).__name__}: {exc}); it was probably cut short "
                f"or damaged in transfer. Copy or compress it again (check it with `{ {'gzip': 'gzip -t', 'bzip2': 'bzip2 -t', 'xz': 'xz -t', 'zstd': 'zstd -t'}[self.compression]} {self.p.name}`)."
            ) from None
        return False


def iter_source(src, digests: dict | None = None, limits: Limits | None = None) -> Iterator[Record | Rejected]:
    """Every record of one configured source, in order. ``digests`` (when given) receives, per file read,
    ``{"sha256": ..., "exact": bool}``: the hash of the bytes the records came from (``exact``), or, for Parquet
    and Arrow folders (read by random access), the file's hash once reading ended. ``limits``: see :class:`Limits`."""
    if src.hub is not None:
        yield from _bounded(read_hub(src.hub, src.hub_config, src.hub_split, src.hub_revision), limits)
        return
    if src.sql is not None:
        yield from _bounded(read_sql(src.sql.url, src.sql.query), limits)
        return
    for f in expand(src.path):
        yield from read_file(f, split=src.hub_split, digests=digests, limits=limits, split_by=getattr(src, "split_by", "document"))


def read_file(p: Path, split: str = "train", digests: dict | None = None, limits: Limits | None = None,
              split_by: str = "document") -> Iterator[Record | Rejected]:
    if _is_arrow_dir(p):
        yield from _bounded(read_arrow_dir(p, split), limits)
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
        yield from _bounded(read_csv(p, digests=digests, max_field=limits.max_record_bytes if limits else None), limits)
        return
    if kind == "txt":
        yield from _bounded(read_txt(p, digests=digests, split_by=split_by), limits)
        return
    reader = {"json": read_json, "parquet": read_parquet}[kind]
    yield from _bounded(reader(p, digests=digests), limits)


def _too_big_reason(size: int, cap: int, what: str = "bytes") -> str:
    return (f"the record is {size:,} {what}, over `data.max_record_bytes` ({cap:,}); it was dropped unparsed and untokenized "
            "(raise `data.max_record_bytes` if such records are wanted, or split them)")


def _too_deep_reason(limit: int) -> str:
    return (f"the record is nested more than {limit} lists/objects deep, which no training example needs (and which Python's "
            "JSON parser and every later stage would recurse through); flatten it")


def _measure(data, cap: int | None, max_depth: int) -> tuple[int, bool]:
    """(characters of text in ``data``, keys included, counting stops past ``cap``; whether it nests deeper than
    ``max_depth``), without recursion."""
    size, stack = 0, [(data, 1)]
    while stack:
        v, d = stack.pop()
        if d > max_depth:
            return size, True
        if isinstance(v, dict):
            for k, x in v.items():
                size += len(k) if isinstance(k, str) else 8
                if isinstance(x, (dict, list, tuple)):
                    stack.append((x, d + 1))
                elif isinstance(x, (str, bytes)):
                    size += len(x)
                else:
                    size += 8
        elif isinstance(v, (list, tuple)):
            for x in v:
                if isinstance(x, (dict, list, tuple)):
                    stack.append((x, d + 1))
                elif isinstance(x, (str, bytes)):
                    size += len(x)
                else:
                    size += 8
        if cap is not None and size > cap:
            return size, False
    return size, False


def _bounded(items: Iterator[Record | Rejected], limits: Limits | None) -> Iterator[Record | Rejected]:
    """Records of a reader that parses before trainpipe sees a record (JSON, Parquet, CSV, TXT, Arrow, hub, SQL):
    one too long or too deeply nested becomes a counted Rejected before anything else looks at it."""
    if limits is None:
        yield from items
        return
    cap = limits.max_record_bytes
    for item in items:
        if isinstance(item, Record):
            size, deep = _measure(item.data, cap, limits.max_depth)
            if deep:
                item = Rejected(item.source, item.line, _too_deep_reason(limits.max_depth), "(not shown)", item.unit, "too_deep")
            elif cap is not None and size > cap:
                head = next((x for x in item.data.values() if isinstance(x, str)), "") if isinstance(item.data, dict) else ""
                item = Rejected(item.source, item.line, _too_big_reason(size, cap, "characters of text or more"), excerpt(head), item.unit, "too_big")
        yield item


def _utf8_error(p: Path, exc: UnicodeDecodeError, line: int | None, base_offset: int = 0) -> DataError:
    where = f"line {line}" if line is not None else f"byte {base_offset + exc.start}"
    return DataError(
        f"`{p}` {where} (byte offset {base_offset + exc.start}) is not valid UTF-8 ({exc.reason}). Re-encode the file as UTF-8 "
        f"(e.g. `iconv -f latin1 -t utf-8 {p.name} > fixed.jsonl`)."
    )


class _Object(dict):
    """A JSON object parsed by :func:`_loads`; ``dups`` names the keys it gave more than once."""

    dups: tuple = ()


def _object(found: list, pairs: list) -> dict:
    out = dict(pairs)
    if len(out) == len(pairs):  # the usual case: a plain dict
        return out
    seen: set = set()
    marked = _Object(out)
    marked.dups = tuple(k for k, _ in pairs if k in seen or seen.add(k))
    found.extend(marked.dups)
    return marked


def _loads(text: str) -> tuple[object, list[str]]:
    """``json.loads`` that also returns the keys an object named twice (plain JSON keeps the last value silently)."""
    found: list[str] = []
    return json.loads(text, object_pairs_hook=lambda pairs: _object(found, pairs)), found


def _dup_keys(value) -> list[str]:
    if isinstance(value, dict):
        return list(getattr(value, "dups", ())) + [k for v in value.values() for k in _dup_keys(v)]
    if isinstance(value, list):
        return [k for v in value for k in _dup_keys(v)]
    return []


def _dup_reason(keys: list[str]) -> str:
    names = ", ".join(f"`{k}`" for k in dict.fromkeys(keys))
    return f"gives the key {names} more than once (JSON would keep only the last value silently); keep one value per key"


def read_jsonl(path: str | Path, digests: dict | None = None, limits: Limits | None = None) -> Iterator[Record | Rejected]:
    """Yield a Record for each JSON object line and a Rejected for each bad line (blank lines are skipped). With
    ``limits``, a line over ``max_record_bytes`` is measured in pieces and dropped unparsed (``too_big``), and one
    nested deeper than ``max_depth`` is ``too_deep``."""
    p = Path(path)
    if not p.is_file():
        hint = "it is a folder; name a .jsonl file inside it" if p.is_dir() else "check `data.sources[].path` (relative paths are resolved against the config file's folder)"
        raise DataError(f"Data file `{p}` does not exist: {hint}.")
    offset = 0
    cap = limits.max_record_bytes if limits is not None else None
    max_depth = limits.max_depth if limits is not None else None
    with _Opened(p, compression_of(p)) as opened:
        lines = _lines(opened, cap)
        for lineno, raw in enumerate(lines, 1):
            start = offset
            if isinstance(raw, _Long):
                offset += raw.size
                yield Rejected(str(p), lineno, _too_big_reason(raw.size, cap), excerpt(raw.head.decode("utf-8", "replace")), kind="too_big")
                continue
            offset += len(raw)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise _utf8_error(p, exc, lineno, start) from None
            if lineno == 1 and line.startswith(_BOM):  # a byte-order mark (Windows editors, Excel exports) is not data
                line = line[1:]
            if not line.strip():
                continue
            try:
                obj, dups = _loads(line)
            except json.JSONDecodeError as exc:
                yield Rejected(str(p), lineno, f"not valid JSON: {exc.msg} at column {exc.colno}", excerpt(line), kind="invalid_json")
                continue
            except RecursionError:  # deeper than the C parser's stack allows
                yield Rejected(str(p), lineno, _too_deep_reason(max_depth or MAX_DEPTH), excerpt(line), kind="too_deep")
                continue
            if max_depth is not None and raw.count(b"[") + raw.count(b"{") > max_depth and _measure(obj, None, max_depth)[1]:
                yield Rejected(str(p), lineno, _too_deep_reason(max_depth), excerpt(line), kind="too_deep")
                continue
            if not isinstance(obj, dict):
                yield Rejected(str(p), lineno, f"a JSON {type(obj).__name__}, not an object", excerpt(line), kind="not_an_object")
                continue
            if dups:
                yield Rejected(str(p), lineno, _dup_reason(dups), excerpt(line), kind="duplicate_key")
                continue
            yield Record(str(p), lineno, obj)
        sha = opened.finish()
    if digests is not None:
        digests[str(p)] = {"sha256": sha, "exact": True}


@dataclass
class _Long:
    """A line longer than the cap: its size in bytes and its first bytes; the rest was read and let go."""

    size: int
    head: bytes


def _lines(opened: _Opened, cap: int | None = None) -> Iterator[bytes | _Long]:
    """The lines of a (decompressed) file; a broken compressed stream is a DataError naming the line it broke at.
    A line of more than ``cap`` bytes (its newline included) is read in 1 MiB pieces and given as a :class:`_Long`."""
    fh = opened.fh
    n = 0
    while True:
        with opened.errors(f" (it breaks after line {n})"):
            line = fh.readline(cap + 1) if cap is not None else fh.readline()
            if not line:
                return
            if cap is not None and len(line) > cap and not line.endswith(b"\n"):
                size, head = len(line), line[:200]
                line = b""
                while True:
                    piece = fh.readline(1 << 20)
                    size += len(piece)
                    if not piece or piece.endswith(b"\n"):
                        break
                n += 1
                yield _Long(size, head)
                continue
        n += 1
        yield line


def _read_bytes(p: Path, digests: dict | None) -> bytes:
    """A whole (decompressed) file, read once; ``digests`` gets the hash of the stored bytes that were read."""
    with _Opened(p, compression_of(p)) as opened:
        raw = opened.read_all()
        sha = opened.finish()
    if digests is not None:  # the bytes parsed by the caller, read once
        digests[str(p)] = {"sha256": sha, "exact": True}
    return raw


def read_json(p: Path, digests: dict | None = None) -> Iterator[Record | Rejected]:
    """A JSON array of objects, or an object of equal-length lists (columns)."""
    raw = _read_bytes(p, digests)
    try:
        text = raw.decode("utf-8").removeprefix(_BOM)
    except UnicodeDecodeError as exc:
        raise _utf8_error(p, exc, None) from None
    try:
        obj, dups = _loads(text)
    except json.JSONDecodeError as exc:
        raise DataError(f"`{p}` is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}. Fix it there, or convert the file to JSONL (one object a line).") from None
    except RecursionError:
        raise DataError(
            f"`{p}` nests lists/objects deeper than Python's JSON parser can follow, so no record of it can be read. Flatten "
            f"the deep record, or convert the file to JSONL (one object a line), where such a record is dropped on its own and counted as `too_deep`."
        ) from None
    del raw, text  # the parsed objects are what is kept
    if getattr(obj, "dups", ()):  # the top level: a column or the `data` wrapper named twice
        raise DataError(f"`{p}` {_dup_reason(list(obj.dups))}, at the top level. Remove the repeated key.")
    if isinstance(obj, dict) and obj and all(isinstance(v, list) for v in obj.values()):
        lengths = {k: len(v) for k, v in obj.items()}
        if len(set(lengths.values())) != 1:
            raise DataError(f"`{p}` is a dict of lists of different lengths ({lengths}); every column must have one value per record.")
        n = next(iter(lengths.values()))
        keys = list(obj)
        for i in range(n):
            rec = {k: obj[k][i] for k in keys}
            bad = _dup_keys(rec) if dups else []
            if bad:
                yield Rejected(str(p), i + 1, _dup_reason(bad), excerpt(json.dumps(rec)), unit="item", kind="duplicate_key")
            else:
                yield Record(str(p), i + 1, rec, unit="item")
        return
    if isinstance(obj, dict) and "data" in obj and isinstance(obj["data"], list):
        obj = obj["data"]
    if not isinstance(obj, list):
        raise DataError(f"`{p}` holds a JSON {type(obj).__name__}; expected an array of objects or an object of lists (columns).")
    for i, item in enumerate(obj, 1):
        bad = _dup_keys(item) if dups else []
        if not isinstance(item, dict):
            yield Rejected(str(p), i, f"item {i} is a JSON {type(item).__name__}, not an object", excerpt(json.dumps(item)), unit="item", kind="not_an_object")
        elif bad:
            yield Rejected(str(p), i, f"item {i} {_dup_reason(bad)}", excerpt(json.dumps(item)), unit="item", kind="duplicate_key")
        else:
            yield Record(str(p), i, item, unit="item")


def read_parquet(p: Path, batch_size: int = 4096, digests: dict | None = None) -> Iterator[Record]:
    """Rows by row group, from one open handle (a file replaced meanwhile is not mixed in); the handle's content is
    hashed when the rows are read, so a file changed in place while it was read is detected."""
    import pyarrow.parquet as pq

    compression_of(p)  # `.parquet.gz` and the like: refused with what works
    with open(p, "rb") as fh:
        try:
            f = pq.ParquetFile(fh)
        except Exception as exc:  # pyarrow raises ArrowInvalid with a useful text
            raise DataError(f"`{p}` is not a readable Parquet file ({exc}). Re-export it, or give a JSONL/CSV file.") from None
        row = 0
        for batch in f.iter_batches(batch_size=batch_size):
            for rec in batch.to_pylist():
                row += 1
                yield Record(str(p), row, rec, unit="row")
        if digests is not None:
            fh.seek(0)
            h = hashlib.sha256()
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
            digests[str(p)] = {"sha256": h.hexdigest(), "exact": False}


def read_csv(p: Path, digests: dict | None = None, max_field: int | None = None) -> Iterator[Record | Rejected]:
    """Rows of a CSV/TSV file with a header. A field longer than ``max_field`` characters (the csv module's
    `field_size_limit`, set for this read) drops its row as ``too_big``; without ``max_field`` the module's limit
    (128 KiB unless changed) holds and a longer field is one DataError."""
    delim = "\t" if file_kind(p)[0] == "tsv" else ","
    old_limit = csv.field_size_limit(max_field) if max_field else None
    try:
        yield from _read_csv(p, delim, digests, max_field)
    finally:
        if old_limit is not None:
            csv.field_size_limit(old_limit)


def _read_csv(p: Path, delim: str, digests: dict | None, max_field: int | None) -> Iterator[Record | Rejected]:
    with _Opened(p, compression_of(p)) as opened, opened.errors():
        fh = io.TextIOWrapper(opened.fh, encoding="utf-8-sig", newline="")  # -sig: a leading byte-order mark is not the first column's name
        reader = None
        try:
            reader = csv.reader(fh, delimiter=delim)
            header = next(reader, None)
            if not header:
                raise DataError(f"`{p}` has no header row; the first row must name the columns.")
            twice = sorted({c for c in header if header.count(c) > 1})
            if twice:
                raise DataError(f"`{p}` header names the column {', '.join(f'`{c}`' for c in twice)} more than once; each record would keep only the last. Rename or remove the repeated column.")
            while True:
                try:
                    row = next(reader)
                except StopIteration:
                    break
                except csv.Error as exc:
                    if "field larger than field limit" not in str(exc):
                        raise DataError(f"`{p}` line {reader.line_num} is not valid CSV ({exc}). Fix that line, or export the file again.") from None
                    if not max_field:
                        raise DataError(
                            f"`{p}` line {reader.line_num} holds a field longer than the csv module's limit ({csv.field_size_limit():,} characters). "
                            "Shorten it, or read the file through `data.sources` (where `data.max_record_bytes` sets the limit)."
                        ) from None
                    yield Rejected(str(p), reader.line_num, _too_big_reason(max_field + 1, max_field, "characters or more in one field"), "(not shown)", kind="too_big")
                    continue
                lineno = reader.line_num
                if not row or all(not c.strip() for c in row):
                    continue
                if len(row) != len(header):
                    yield Rejected(
                        str(p), lineno, f"ragged row: {len(row)} fields, the header has {len(header)}", excerpt(delim.join(row)), kind="ragged_row"
                    )
                    continue
                yield Record(str(p), lineno, dict(zip(header, row)))
        except UnicodeDecodeError as exc:
            near = reader.line_num + 1 if reader is not None else 1
            raise DataError(f"`{p}` (near line {near}) is not valid UTF-8 ({exc.reason}). Re-encode the file as UTF-8.") from None
        fh.detach()  # the Opened closes the streams under it
        sha = opened.finish()
    if digests is not None:
        digests[str(p)] = {"sha256": sha, "exact": True}


def read_txt(p: Path, digests: dict | None = None, split_by: str = "document") -> Iterator[Record]:
    """Raw-text records of a .txt file (for continued pretraining): the whole file (``split_by: document``), each
    non-blank line (``line``), or each block of lines between blank lines (``paragraph``); a record's ``line`` is the
    line it starts on."""
    raw = _read_bytes(p, digests)
    try:
        text = raw.decode("utf-8").removeprefix(_BOM)
    except UnicodeDecodeError as exc:
        raise _utf8_error(p, exc, None) from None
    if split_by == "document":
        yield Record(str(p), 1, {"text": text}, unit="file")
        return
    block: list[str] = []
    start = 0
    for n, line in enumerate(text.splitlines(), 1):
        if split_by == "line":
            if line.strip():
                yield Record(str(p), n, {"text": line}, unit="line")
            continue
        if line.strip():
            if not block:
                start = n
            block.append(line)
        elif block:
            yield Record(str(p), start, {"text": "\n".join(block)}, unit="line")
            block = []
    if block:
        yield Record(str(p), start, {"text": "\n".join(block)}, unit="line")


def read_arrow_dir(p: Path, split: str = "train") -> Iterator[Record]:
    from datasets import DatasetDict, load_from_disk

    ds = load_from_disk(str(p))  # memory-mapped Arrow
    if isinstance(ds, DatasetDict):
        if split not in ds:
            raise DataError(f"`{p}` is a DatasetDict with splits {', '.join(ds)}; set `hub_split` on the source to one of them.")
        ds = ds[split]
    for i, rec in enumerate(ds, 1):
        yield Record(str(p), i, rec, unit="row")


def read_hub(name: str, config: str | None, split: str, revision: str | None = None) -> Iterator[Record]:
    import datasets

    try:
        ds = datasets.load_dataset(name, config, split=split, streaming=True, revision=revision)
        it = iter(ds)
        first = next(it, None)
    except Exception as exc:  # offline, unknown id, missing config: datasets raises many types
        offline = any(__import__("os").environ.get(v) == "1" for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))
        why = "the hub is offline (HF_HUB_OFFLINE/HF_DATASETS_OFFLINE is set) and it is not in the local cache" if offline else f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        raise DataError(
            f"Cannot read the hub dataset `{name}`" + (f" (config `{config}`)" if config else "") + f", split `{split}`: {why}. "
            f"On a machine with network access run `python -c \"import datasets; datasets.load_dataset('{name}').save_to_disk('data/{name.split('/')[-1]}')\"` "
            "and point `data.sources[].path` at that folder."
        ) from None
    if first is None:
        return
    yield Record(f"hub:{name}", 1, dict(first), unit="row")
    for i, rec in enumerate(it, 2):
        yield Record(f"hub:{name}", i, dict(rec), unit="row")


# Words that write, change the schema or reach outside the database. A query is refused when one appears outside
# string literals, quoted names and comments (conservative: a column named like one must be quoted, e.g. `"update"`).
# `INTO` covers `SELECT ... INTO new_table` and `INTO OUTFILE`; `UPDATE` covers `FOR UPDATE` row locks.
_SQL_WRITE_WORDS = frozenset((
    "insert", "update", "delete", "merge", "upsert", "drop", "create", "alter", "truncate", "rename", "grant", "revoke",
    "attach", "detach", "pragma", "vacuum", "reindex", "copy", "call", "exec", "execute", "into", "lock", "load_extension",
))
# Two ways to read literals and comments: standard SQL (SQLite, PostgreSQL: `''` escapes a quote) and MySQL's
# (backslash escapes, `#` comments). A query must pass under both, so a quote one dialect reads differently cannot
# hide a word from the check. `/*! ... */` (code MySQL executes) is not treated as a comment.
_SQL_LEXINGS = (
    re.compile(r"--[^\n]*|/\*(?!!).*?\*/|'(?:[^']|'')*'|\"(?:[^\"]|\"\")*\"|`[^`]*`|\[[^\]]*\]|\$\$.*?\$\$", re.S),
    re.compile(r"--[^\n]*|#[^\n]*|/\*(?!!).*?\*/|'(?:[^'\\]|\\.|'')*'|\"(?:[^\"\\]|\\.|\"\")*\"|`[^`]*`", re.S),
)


def check_select(query: str) -> None:
    """Refuse (DataError) a SQL source query that is not one read-only SELECT, before anything is executed.

    The rule: one statement (a trailing `;` is allowed, no `;` chaining), starting with SELECT or WITH, holding
    none of the words that write or change state (:data:`_SQL_WRITE_WORDS`) outside literals and quoted names.
    This is the first guard; :func:`readonly_engine` is the second (SQLite and PostgreSQL connections that
    cannot write)."""
    fix = "`sql.query` must be one read-only SELECT (or WITH ... SELECT); copy the rows you need with a SELECT, and make any change to the database outside trainpipe."
    for lexing in _SQL_LEXINGS:
        stripped = lexing.sub(lambda m: " " if m.group(0).startswith(("--", "#", "/*")) else " _lit_ ", query).strip()
        body = stripped[:-1].rstrip() if stripped.endswith(";") else stripped
        if ";" in body:
            raise DataError(f"`sql.query` holds more than one statement (`;` inside it): `{excerpt(query, 120)}`. Nothing was executed. {fix}")
        first = body.split(None, 1)[0].lower() if body else ""
        if first not in ("select", "with"):
            raise DataError(f"`sql.query` starts with `{first or '(nothing)'}`, not SELECT or WITH: `{excerpt(query, 120)}`. Nothing was executed. {fix}")
        words = sorted({w for w in re.findall(r"[a-z_]+", body.lower()) if w in _SQL_WRITE_WORDS})
        if words:
            raise DataError(
                f"`sql.query` uses {', '.join(f'`{w.upper()}`' for w in words)}, which can write or change the database: "
                f"`{excerpt(query, 120)}`. Nothing was executed. {fix} (A column with such a name must be quoted, e.g. `\"{words[0]}\"`.)"
            )


def readonly_engine(url: str):
    """A SQLAlchemy engine whose connections cannot write where the driver allows it: SQLite files are opened with
    `mode=ro` (a missing file is an error, not a new empty database), PostgreSQL sessions are
    `SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY`. Other dialects (MySQL, SQL Server, ...) get only the
    statement check of :func:`check_select`."""
    import sqlalchemy as sa

    u = sa.engine.make_url(url)
    if u.get_backend_name() == "sqlite":
        import sqlite3
        from urllib.request import pathname2url

        db = u.database or ""
        if db in ("", ":memory:"):
            raise DataError(f"`sql.url` `{url}` names an in-memory SQLite database, which is always empty; name the database file, e.g. `sqlite:///data.db`.")
        if db.startswith("file:"):
            target = db + ("&" if "?" in db else "?") + "mode=ro"
        else:
            path = Path(db).expanduser().resolve()
            if not path.is_file():
                raise DataError(f"The SQLite database `{path}` of `sql.url` does not exist; check the path (relative paths are resolved against the config file's folder).")
            target = f"file:{pathname2url(str(path))}?mode=ro"
        return sa.create_engine("sqlite://", creator=lambda: sqlite3.connect(target, uri=True, check_same_thread=False))
    engine = sa.create_engine(url)
    if u.get_backend_name() == "postgresql":

        @sa.event.listens_for(engine, "connect")
        def _read_only(dbapi_conn, _record):  # every transaction of the session is READ ONLY, for any PostgreSQL driver
            cur = dbapi_conn.cursor()
            cur.execute("SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY")
            cur.close()
            dbapi_conn.commit()  # a rolled-back SET would be undone

    return engine


def read_sql(url: str, query: str) -> Iterator[Record]:
    """Rows of one read-only SELECT, streamed. The statement is checked before anything is executed, and runs on a
    connection that cannot write where the driver allows (see :func:`readonly_engine`)."""
    try:
        import sqlalchemy as sa
    except ImportError:
        raise DataError("A `sql` source needs SQLAlchemy: `pip install 'trainpipe[sql]'`.") from None
    check_select(query)
    try:
        engine = readonly_engine(url)
    except DataError:
        raise
    except Exception as exc:
        raise DataError(f"`sql.url` `{redact_url(url)}` is not a usable database URL ({exc}). Write it as `dialect://user@host/db`, e.g. `sqlite:///data.db`.") from None
    try:
        with engine.connect() as conn:
            result = conn.execution_options(stream_results=True, yield_per=2000).execute(sa.text(query))
            keys = list(result.keys())
            label = f"sql:{redact_url(url)}"  # rides along with every record (reports, rejected.jsonl, cache): no credential
            for i, row in enumerate(result, 1):
                yield Record(label, i, dict(zip(keys, row)), unit="row")
            conn.rollback()  # read-only: nothing to keep
    except sa.exc.SQLAlchemyError as exc:
        raise DataError(f"The SQL query of source `{redact_url(url)}` failed: {str(exc).splitlines()[0]}. Fix `sql.query` (it must be a SELECT).") from None
    finally:
        engine.dispose()
