"""Issue 14 item 1: a file that starts with a UTF-8 byte-order mark keeps its first record; gzip (and bzip2, xz)
compressed JSONL/JSON/CSV files are read as they are decompressed; any other compression is one paragraph naming the
file and what works. The cache key is the hash of the stored (compressed) bytes that were read, and the data
report's line numbers are those of the decompressed text."""

from __future__ import annotations

import bz2
import gzip
import hashlib
import json
import lzma
import zipfile

import pytest

from trainpipe.config import DataConfig
from trainpipe.data.prepare import prepare
from trainpipe.data.sources import Record, Rejected, read_file
from trainpipe.data.tokenize import setup_chat_template
from trainpipe.errors import DataError

BOM = b"\xef\xbb\xbf"
RECS = [{"instruction": f"Say item {i}.", "output": f"item {i} said"} for i in range(12)]


@pytest.fixture()
def tok(tiny_tokenizer):
    setup_chat_template(tiny_tokenizer, "auto", "tiny")
    return tiny_tokenizer


def jsonl_bytes(recs=RECS) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in recs).encode()


def csv_bytes(recs=RECS) -> bytes:
    return ("instruction,output\r\n" + "".join(f"{r['instruction']},{r['output']}\r\n" for r in recs)).encode()


def records(path) -> list:
    return list(read_file(path))


@pytest.mark.parametrize("name,body", [("d.jsonl", jsonl_bytes()), ("d.json", json.dumps(RECS).encode()), ("d.csv", csv_bytes())])
def test_a_byte_order_mark_does_not_cost_the_first_record(tmp_path, name, body):
    p = tmp_path / name
    p.write_bytes(BOM + body)
    got = records(p)
    assert all(isinstance(r, Record) for r in got), [r for r in got if isinstance(r, Rejected)]
    assert [r.data for r in got] == RECS  # the CSV's first column is `instruction`, not `\ufeffinstruction`
    assert got[0].line == (2 if name.endswith(".csv") else 1)


def test_a_byte_order_mark_in_a_text_file_is_not_text(tmp_path):
    p = tmp_path / "t.txt"
    p.write_bytes(BOM + b"Once upon a time.")
    assert records(p)[0].data == {"text": "Once upon a time."}


COMPRESS = {".gz": gzip.compress, ".bz2": bz2.compress, ".xz": lzma.compress}


@pytest.mark.parametrize("suffix", list(COMPRESS))
@pytest.mark.parametrize("inner,body", [(".jsonl", jsonl_bytes()), (".json", json.dumps(RECS).encode()), (".csv", csv_bytes())])
def test_compressed_files_are_read(tmp_path, suffix, inner, body):
    p = tmp_path / f"d{inner}{suffix}"
    p.write_bytes(COMPRESS[suffix](BOM + body if suffix == ".gz" else body))  # a BOM inside a .gz too
    digests: dict = {}
    got = list(read_file(p, digests=digests))
    assert [r.data for r in got] == RECS
    assert digests[str(p)] == {"sha256": hashlib.sha256(p.read_bytes()).hexdigest(), "exact": True}  # the stored bytes


def test_a_gzip_file_without_the_suffix_is_read_by_its_content(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_bytes(gzip.compress(jsonl_bytes()))
    assert [r.data for r in records(p)] == RECS


def test_prepare_reads_jsonl_gz_with_right_lines_and_a_key_of_the_stored_bytes(tmp_path, tok):
    lines = [json.dumps(r) for r in RECS[:5]] + ["{not json"] + [json.dumps(r) for r in RECS[5:]]
    p = tmp_path / "d.jsonl.gz"
    p.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    cfg = DataConfig(sources=[{"path": str(p)}], eval_split=2, cache_dir=str(tmp_path / "c"), on_error="skip")
    first = prepare(cfg, tok, train_on="assistant", seed=0, rejected_path=tmp_path / "rejected.jsonl")
    r = first.report
    assert r["records_read"] == 13 and r["train_examples"] + r["eval_examples"] == 12
    (row,) = [json.loads(x) for x in (tmp_path / "rejected.jsonl").read_text().splitlines()]
    assert row["line"] == 6 and row["source"] == str(p)  # the line of the decompressed text
    sha = hashlib.sha256(p.read_bytes()).hexdigest()
    assert r["sources"][0]["sha256"] == sha
    again = prepare(cfg, tok, train_on="assistant", seed=0)
    assert again.report["cache"]["hit"] is True and again.report["cache"]["key"] == r["cache"]["key"]
    # the same records compressed differently are other bytes: another key (the key is what was read, not what it means)
    p.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode(), compresslevel=1))
    assert hashlib.sha256(p.read_bytes()).hexdigest() != sha
    third = prepare(cfg, tok, train_on="assistant", seed=0)
    assert third.report["cache"]["hit"] is False and third.report["cache"]["key"] != r["cache"]["key"]


def test_a_glob_and_a_folder_find_compressed_files(tmp_path, tok):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.jsonl.gz").write_bytes(gzip.compress(jsonl_bytes(RECS[:6])))
    (tmp_path / "data" / "b.jsonl").write_bytes(jsonl_bytes(RECS[6:]))
    for path in (str(tmp_path / "data" / "*"), str(tmp_path / "data")):
        cfg = DataConfig(sources=[{"path": path}], eval_split=2, cache_dir=str(tmp_path / "c"))
        assert prepare(cfg, tok, train_on="assistant", seed=0).report["records_read"] == 12


def _zip(p):
    with zipfile.ZipFile(p, "w") as z:
        z.writestr("d.jsonl", jsonl_bytes())


@pytest.mark.parametrize("name,make,says", [
    ("d.jsonl.zip", _zip, "zip-compressed (its name ends in `.zip`)"),
    ("d.jsonl", _zip, "zip-compressed (its first bytes say so)"),
    ("d.jsonl.lz4", lambda p: p.write_bytes(b"\x04\x22\x4d\x18" + b"\0" * 20), "LZ4-compressed"),
    ("d.jsonl.7z", lambda p: p.write_bytes(b"7z\xbc\xaf\x27\x1c" + b"\0" * 20), "7-Zip-compressed"),
])
def test_other_compressions_are_one_clear_error(tmp_path, name, make, says):
    p = tmp_path / name
    make(p)
    with pytest.raises(DataError) as exc:
        records(p)
    msg = exc.value.message
    assert str(p) in msg and says in msg and ".gz, .bz2, .xz" in msg and "\n" not in msg


def test_zstd_is_read_with_zstandard(tmp_path):
    zstandard = pytest.importorskip("zstandard")  # the `zstd` extra (and dev)
    p = tmp_path / "d.jsonl.zst"
    p.write_bytes(zstandard.ZstdCompressor().compress(jsonl_bytes()))
    digests: dict = {}
    assert [r.data for r in read_file(p, digests=digests)] == RECS
    assert digests[str(p)]["sha256"] == hashlib.sha256(p.read_bytes()).hexdigest()
    q = tmp_path / "d2.jsonl"  # by its first bytes too
    q.write_bytes(p.read_bytes())
    assert [r.data for r in records(q)] == RECS


def test_zstd_without_zstandard_says_how(tmp_path, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "zstandard", None)  # as if the package were not installed
    p = tmp_path / "d.jsonl.zst"
    p.write_bytes(b"\x28\xb5\x2f\xfd" + b"\0" * 20)
    with pytest.raises(DataError, match=r"zstd-compressed .*`pip install 'trainpipe\[zstd\]'`"):
        records(p)


def _zstd(data: bytes) -> bytes:
    zstandard = pytest.importorskip("zstandard")
    return zstandard.ZstdCompressor().compress(data[: len(data) // 2]) + zstandard.ZstdCompressor().compress(data[len(data) // 2 :])  # two frames


@pytest.mark.parametrize("suffix,name,check", [(".gz", "gzip", "gzip -t"), (".bz2", "bzip2", "bzip2 -t"), (".xz", "xz", "xz -t"), (".zst", "zstd", "zstd -t")])
def test_a_truncated_file_names_the_file_and_where_it_broke(tmp_path, suffix, name, check):
    compress = {**COMPRESS, ".zst": _zstd}[suffix]
    whole_data = jsonl_bytes(RECS * 50)
    p = tmp_path / f"d.jsonl{suffix}"
    whole = compress(whole_data)
    if suffix == ".zst":  # the two frames whole read as one file
        p.write_bytes(whole)
        assert len(records(p)) == len(RECS) * 50
    p.write_bytes(whole[: len(whole) * 3 // 4])
    with pytest.raises(DataError) as exc:
        records(p)
    assert str(p) in exc.value.message and f"not a complete {name} file (it breaks after line" in exc.value.message and check in exc.value.message


def test_parquet_inside_gzip_is_refused_with_the_fix(tmp_path):
    p = tmp_path / "d.parquet.gz"
    p.write_bytes(gzip.compress(b"PAR1"))
    with pytest.raises(DataError, match=r"Parquet compresses its own columns"):
        records(p)
