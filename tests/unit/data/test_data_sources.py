"""Every source kind reads the same records; bad input names the file and line, row or byte offset."""

import json

import pytest

from trainpipe.config import DataConfig, DataSource
from trainpipe.data.prepare import prepare
from trainpipe.data.sources import iter_source
from trainpipe.data.tokenize import setup_chat_template
from trainpipe.errors import DataError

RECS = [{"instruction": f"Say item {i}.", "input": "", "output": f"item {i} said"} for i in range(30)]


@pytest.fixture()
def tok(tiny_tokenizer):
    setup_chat_template(tiny_tokenizer, "auto", "tiny")
    return tiny_tokenizer


def records(**src):
    return [r for r in iter_source(DataSource(**src))]


def datas(**src):
    return [{k: r.data[k] for k in ("instruction", "input", "output")} for r in records(**src)]


def test_jsonl_json_parquet_csv_tsv_read_the_same(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECS))
    (tmp_path / "b.json").write_text(json.dumps(RECS))
    (tmp_path / "c.json").write_text(json.dumps({k: [r[k] for r in RECS] for k in RECS[0]}))
    pq.write_table(pa.Table.from_pylist(RECS), tmp_path / "d.parquet", row_group_size=7)
    for name, sep in (("e.csv", ","), ("f.tsv", "\t")):
        lines = [sep.join(RECS[0])] + [sep.join(r.values()) for r in RECS]
        (tmp_path / name).write_text("\n".join(lines) + "\n")
    for name in ("a.jsonl", "b.json", "c.json", "d.parquet", "e.csv", "f.tsv"):
        assert datas(path=str(tmp_path / name)) == RECS, name
    rows = records(path=str(tmp_path / "d.parquet"))
    assert rows[-1].line == 30 and rows[-1].unit == "row"


def test_save_to_disk_folder_glob_and_folder(tmp_path):
    from datasets import Dataset, DatasetDict

    Dataset.from_list(RECS).save_to_disk(str(tmp_path / "arrow"))
    assert datas(path=str(tmp_path / "arrow")) == RECS
    DatasetDict({"train": Dataset.from_list(RECS[:5]), "test": Dataset.from_list(RECS[5:])}).save_to_disk(str(tmp_path / "dd"))
    assert datas(path=str(tmp_path / "dd"), hub_split="test") == RECS[5:]
    with pytest.raises(DataError, match="splits train, test"):
        records(path=str(tmp_path / "dd"), hub_split="validation")
    folder = tmp_path / "parts"
    folder.mkdir()
    for k in range(3):
        (folder / f"p{k}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECS[k * 10 : (k + 1) * 10]))
    assert datas(path=str(folder / "p*.jsonl")) == RECS
    assert datas(path=str(folder)) == RECS
    with pytest.raises(DataError, match="matches no data file"):
        records(path=str(folder / "*.parquet"))


def test_txt_files_are_raw_text_records(tmp_path, tok):
    d = tmp_path / "books"
    d.mkdir()
    for k in range(12):
        (d / f"b{k}.txt").write_text(f"Chapter {k}. The river ran past stone number {k} and the garden {k}.\n")
    # one row per text (`pretrain_blocks: document`; the default `stream` joins them into blocks, tests/unit/data/test_public_like.py)
    data = prepare(DataConfig(sources=[{"path": str(d)}], eval_split=2, cache_dir=str(tmp_path / "c"), pretrain_blocks="document"), tok,
                   train_on="assistant", seed=0)
    assert data.report["sources"][0]["format"] == "text" and data.report["records_kept"] == 12
    row = data.train[0]
    assert all(l != -100 for l in row["labels"]) and row["input_ids"][-1] == tok.eos_token_id  # EOS appended and trained


def test_sql_source_on_sqlite(tmp_path):
    import sqlite3

    pytest.importorskip("sqlalchemy")

    db = tmp_path / "d.db"
    con = sqlite3.connect(db)
    con.execute("create table t (instruction text, input text, output text)")
    con.executemany("insert into t values (?, ?, ?)", [tuple(r.values()) for r in RECS])
    con.commit()
    con.close()
    assert datas(sql={"url": f"sqlite:///{db}", "query": "select * from t order by rowid"}) == RECS
    with pytest.raises(DataError, match="SQL query .* failed"):
        records(sql={"url": f"sqlite:///{db}", "query": "select * from missing"})


def test_hub_id_offline_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(DataError) as info:
        records(hub="nobody/no-such-dataset")
    msg = info.value.message
    assert "nobody/no-such-dataset" in msg and "offline" in msg and "save_to_disk" in msg


def test_non_utf8_names_line_and_byte_offset(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_bytes(b'{"instruction": "a", "output": "b"}\n{"instruction": "caf\xe9", "output": "b"}\n')
    with pytest.raises(DataError, match=r"line 2 \(byte offset 56\) is not valid UTF-8"):
        records(path=str(p))


def test_ragged_csv_row_empty_file_and_missing_file(tmp_path, tok):
    p = tmp_path / "d.csv"
    p.write_text("instruction,input,output\nSay a.,,a said\nSay b.,x,b said,extra\n")
    with pytest.raises(DataError, match=r"d.csv` line 3: ragged row: 4 fields, the header has 3"):
        prepare(DataConfig(sources=[{"path": str(p)}], cache_dir=str(tmp_path / "c")), tok, train_on="assistant", seed=0)
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError, match="is empty"):
        records(path=str(tmp_path / "empty.jsonl"))
    with pytest.raises(DataError, match="does not exist"):
        records(path=str(tmp_path / "missing.jsonl"))


def test_one_origin_per_source():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="exactly one of"):
        DataSource(path="a.jsonl", hub="x/y")
    with pytest.raises(ValidationError, match="not both"):
        DataSource(path="a.jsonl", weight=0.5, max_records=3)


def test_weight_and_max_records_mix_deterministically(tmp_path, tok):
    a = tmp_path / "a.jsonl"
    b = tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps({"instruction": f"Say a{i}.", "output": f"a{i}"}) + "\n" for i in range(100)))
    b.write_text("".join(json.dumps({"instruction": f"Say b{i}.", "output": f"b{i}"}) + "\n" for i in range(100)))

    def run(seed, **kw):
        c = DataConfig(sources=[{"path": str(a), "weight": 0.5}, {"path": str(b), "max_records": 20}], eval_split=5, cache_dir=str(tmp_path / "c"), **kw)
        return prepare(c, tok, train_on="assistant", seed=seed)

    d1, d2, d3 = run(0), run(0), run(1)
    r = d1.report
    assert r["dropped"]["max_records"] == 80 and 35 <= r["dropped"]["subsampled"] <= 65
    assert r["records_read"] == 200 == r["records_kept"] + sum(r["dropped"].values())
    assert list(d1.train["input_ids"]) == list(d2.train["input_ids"]) and list(d1.train["input_ids"]) != list(d3.train["input_ids"])
    up = DataConfig(sources=[{"path": str(a), "weight": 2.5}], eval_split=10, cache_dir=str(tmp_path / "c"))
    rep = prepare(up, tok, train_on="assistant", seed=0).report
    assert rep["splits"]["train"]["records"] == 90 and 90 * 2 < rep["splits"]["train"]["rows"] < 90 * 3
    assert rep["repeated"] == rep["splits"]["train"]["rows"] - 90 and rep["records_kept"] == 100


def test_check_sources_names_the_source_index(tmp_path):
    from trainpipe.data.sources import check_sources

    (tmp_path / "a.jsonl").write_text("{}\n")
    check_sources([DataSource(path=str(tmp_path / "a.jsonl")), DataSource(hub="x/y")])
    with pytest.raises(DataError, match=r"`data.sources\[1\].path`: The glob .* matches no data file"):
        check_sources([DataSource(path=str(tmp_path / "a.jsonl")), DataSource(path=str(tmp_path / "*.parquet"))])
