"""plan/row_count.py counts what the data step's readers read (issue 30): a quoted field over several lines is one row,
blank and whitespace-only rows are none, a ragged row is one (the data step rejects it later), compressed files and TSV
alike; each file is read once while it is unchanged."""

from __future__ import annotations

import gzip

from trainpipe.config import RunConfig
from trainpipe.data.sources import iter_source
from trainpipe.plan import row_count

CSV = 'a,b,label\n1,"two\nlines",x\n\n , ,\n3,4,y\n5,6\n"7","8",z\n'  # 4 rows: the multi-line one, 3/4, the ragged 5/6, 7/8


def _src(path):
    return RunConfig.model_validate({"model": {"args": {}}, "data": {"sources": [{"path": str(path)}], "label": "label"}}).data.sources[0]


def test_counts_equal_what_the_readers_read(tmp_path):
    (tmp_path / "t.csv").write_text(CSV)
    (tmp_path / "t.tsv").write_text(CSV.replace(",", "\t"))
    (tmp_path / "t.csv.gz").write_bytes(gzip.compress(CSV.encode()))
    (tmp_path / "t.jsonl").write_text('{"a": 1}\n\n{"a": 2}\n  \n{"a": 3}\n')
    for name, n in [("t.csv", 4), ("t.tsv", 4), ("t.csv.gz", 4), ("t.jsonl", 3)]:
        src = _src(tmp_path / name)
        assert row_count.source_rows(src) == sum(1 for _ in iter_source(src)) == n, name


def test_a_file_is_read_once_until_it_changes(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text(CSV)
    before = row_count.READS["files"]
    assert [row_count.source_rows(_src(p)) for _ in range(3)] == [4, 4, 4]
    assert row_count.READS["files"] == before + 1
    p.write_text(CSV + "9,10,w\n")
    assert row_count.source_rows(_src(p)) == 5 and row_count.READS["files"] == before + 2
