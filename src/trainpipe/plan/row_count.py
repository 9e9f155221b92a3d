"""How many rows a table source holds, counted cheaply and once per file (issue 30): what
`training.per_device_train_batch_size: auto` for tables and images divides (plan/family_plan.py `training_rows`).

- Parquet: the row count in the file's footer (pyarrow's metadata: no column is read).
- CSV/TSV, plain or compressed: one pass of the csv module's reader, counting the non-blank rows after the header (a quoted
  field over several lines is one row, as the data step reads it); JSONL: its non-blank lines.
- Anything else (JSON, TXT, an Arrow folder, SQL, the hub): every record read through data/sources.py.

A file's count is kept for the life of the process under its content key (resolved path, size, modification and inode
change times, inode: a rewrite changes them): `plan` resolves a config more than once and `run` resolves it before its
data step, and the file is read once. The count is of the rows as stored, before the data step's cleaning (exact
duplicates and rejected rows are removed there); the printed rule says so.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

from trainpipe.data.files import Opened, compression_of, file_kind
from trainpipe.data.sources import expand, iter_source, read_file

_COUNTS: dict[tuple, int] = {}
READS = {"files": 0}  # files read to count their rows in this process (a second resolve of the same file reads none)


def source_rows(src) -> int:
    """The rows of one configured source as stored (before cleaning)."""
    if src.hub is not None or src.sql is not None or not src.path:
        return sum(1 for _ in iter_source(src))
    return sum(file_rows(f, src) for f in expand(src.path))


def file_rows(p: Path, src=None) -> int:
    """The rows of one data file, from the process's cache when the file is unchanged since it was counted."""
    st = p.stat()
    key = (str(p.resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
    if key not in _COUNTS:
        READS["files"] += 1
        _COUNTS[key] = _count(p, src)
    return _COUNTS[key]


def _count(p: Path, src) -> int:
    kind = file_kind(p)[0] if p.is_file() else None
    if kind == "parquet":
        import pyarrow.parquet as pq

        return int(pq.ParquetFile(p).metadata.num_rows)
    if kind in ("csv", "tsv", "jsonl"):
        with Opened(p, compression_of(p)) as opened, opened.errors():
            if kind == "jsonl":
                return sum(1 for line in opened.fh if line.strip())
            fh = io.TextIOWrapper(opened.fh, encoding="utf-8-sig", newline="")
            rows = sum(1 for row in csv.reader(fh, delimiter="\t" if kind == "tsv" else ",") if any(c.strip() for c in row))
            fh.detach()  # the Opened closes the streams under it
            return max(0, rows - 1)  # the header
    return sum(1 for _ in read_file(p, split=getattr(src, "hub_split", "train"), split_by=getattr(src, "split_by", "auto")))
