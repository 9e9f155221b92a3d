"""The file readers: JSONL, JSON, Parquet, CSV/TSV, TXT and `datasets.save_to_disk` folders, each a generator of
records (data/records.py) that loads nothing whole it does not have to (Parquet by row group, Arrow memory-mapped).

The ``line`` of a record is its line number (JSONL, CSV, TXT; of the decompressed text for a compressed file) or its
1-based row / item index (``unit`` says which). A UTF-8 byte-order mark at the start of a text file is not part of its
first record. Each reader puts the hash of the bytes it read in ``digests`` (see data/sources.py's :func:`iter_source`).
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from trainpipe import ui
from trainpipe.data.files import Opened, compression_of, file_kind
from trainpipe.data.records import MAX_DEPTH, Limits, Record, Rejected, excerpt, measure, too_big_reason, too_deep_reason
from trainpipe.errors import DataError

_BOM = "\ufeff"


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
    with Opened(p, compression_of(p)) as opened:
        lines = _lines(opened, cap)
        for lineno, raw in enumerate(lines, 1):
            start = offset
            if isinstance(raw, _Long):
                offset += raw.size
                yield Rejected(str(p), lineno, too_big_reason(raw.size, cap), excerpt(raw.head.decode("utf-8", "replace")), kind="too_big")
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
                yield Rejected(str(p), lineno, too_deep_reason(max_depth or MAX_DEPTH), excerpt(line), kind="too_deep")
                continue
            if max_depth is not None and raw.count(b"[") + raw.count(b"{") > max_depth and measure(obj, None, max_depth)[1]:
                yield Rejected(str(p), lineno, too_deep_reason(max_depth), excerpt(line), kind="too_deep")
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


def _lines(opened: Opened, cap: int | None = None) -> Iterator[bytes | _Long]:
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
    with Opened(p, compression_of(p)) as opened:
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
    with Opened(p, compression_of(p)) as opened, opened.errors():
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
                    yield Rejected(str(p), reader.line_num, too_big_reason(max_field + 1, max_field, "characters or more in one field"), "(not shown)", kind="too_big")
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


def read_txt(p: Path, digests: dict | None = None, split_by: str = "auto") -> Iterator[Record]:
    """Raw-text records of a .txt file (for continued pretraining): the whole file (``split_by: document``), each
    non-blank line (``line``), or each block of lines between blank lines (``paragraph``); ``auto`` reads the file's
    shape (:func:`txt_shape`: one document a line -> ``line``, else ``document``) and says it on the console. A record's
    ``line`` is the line it starts on."""
    raw = _read_bytes(p, digests)
    try:
        text = raw.decode("utf-8").removeprefix(_BOM)
    except UnicodeDecodeError as exc:
        raise _utf8_error(p, exc, None) from None
    if split_by == "auto":
        split_by, why = txt_shape(text)
        _say_split(p, split_by, why)
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


DOC_LINE_CHARS = 200  # a median line this long, with no blank line in the file: one document a line (wiki_demo.txt)


def txt_shape(text: str) -> tuple[str, str]:
    """(`split_by` for ``split_by: auto``, why): `line` for a file of one document a line (no blank line, at least two
    lines, the median line at least DOC_LINE_CHARS characters: LLaMA-Factory's wiki_demo.txt, one article a line);
    `document` otherwise (prose wrapped at ~80 characters, or paragraphs between blank lines, is one document)."""
    lines = text.splitlines()
    filled = [len(x) for x in lines if x.strip()]
    blank = len(lines) - len(filled)
    if len(filled) >= 2 and not blank:
        median = sorted(filled)[len(filled) // 2]
        if median >= DOC_LINE_CHARS:
            return "line", f"{len(filled):,} lines, no blank line, median {median:,} characters a line: one document a line"
        return "document", f"{len(filled):,} lines of median {median:,} characters: wrapped text, one document"
    return "document", f"{len(filled):,} non-blank and {blank:,} blank lines: one document"


_SAID_SPLIT: set = set()


def _say_split(p: Path, split_by: str, why: str) -> None:
    """The shape `split_by: auto` read, said once per file on the console, with the key that changes it."""
    if str(p) in _SAID_SPLIT:
        return
    _SAID_SPLIT.add(str(p))
    other = "document" if split_by == "line" else "line` or `paragraph"
    ui.console().print(f"  {p.name}: read with split_by {split_by} ({why}); set `split_by: {other}` on the source to read it otherwise",
                       markup=False, highlight=False, soft_wrap=True)


def read_arrow_dir(p: Path, split: str = "train") -> Iterator[Record]:
    from datasets import DatasetDict, load_from_disk

    ds = load_from_disk(str(p))  # memory-mapped Arrow
    if isinstance(ds, DatasetDict):
        if split not in ds:
            raise DataError(f"`{p}` is a DatasetDict with splits {', '.join(ds)}; set `hub_split` on the source to one of them.")
        ds = ds[split]
    for i, rec in enumerate(ds, 1):
        yield Record(str(p), i, rec, unit="row")
