"""The cache cannot be poisoned: a file that changes after it was hashed for the cache lookup and before it is read
is cached under the hash of what was read, never under the old hash."""

import hashlib
import json

import pytest

from trainpipe.config import DataConfig
from trainpipe.data import cache as cache_mod
from trainpipe.data import prepare as prepare_mod
from trainpipe.data.prepare import prepare
from trainpipe.data.sources import read_file
from trainpipe.data.tokenize import setup_chat_template
from trainpipe.errors import DataError


@pytest.fixture()
def tok(tiny_tokenizer):
    setup_chat_template(tiny_tokenizer, "auto", "tiny")
    return tiny_tokenizer


def lines(tag: str, n: int = 30) -> str:
    return "".join(json.dumps({"instruction": f"Say {tag} {i}.", "output": f"{tag} {i} said"}) + "\n" for i in range(n))


def run(src, tok, cache):
    return prepare(DataConfig(sources=[{"path": str(src)}], eval_split=4, cache_dir=str(cache)), tok, train_on="assistant", seed=0)


def test_a_file_changed_after_hashing_is_cached_under_what_was_read(tmp_path, tok, monkeypatch):
    src = tmp_path / "d.jsonl"
    src.write_text(lines("old"))
    old_key = run(src, tok, tmp_path / "a").report["cache"]["key"]  # the key of the old content

    real = prepare_mod.fingerprint

    def hash_then_change(s):  # the race: the file is rewritten right after it was hashed for the lookup
        out = real(s)
        src.write_text(lines("new"))
        return out

    monkeypatch.setattr(prepare_mod, "fingerprint", hash_then_change)
    raced = run(src, tok, tmp_path / "b")
    monkeypatch.setattr(prepare_mod, "fingerprint", real)

    new_sha = hashlib.sha256(src.read_bytes()).hexdigest()
    assert raced.report["sources"][0]["sha256"] == new_sha  # the report names what was read
    assert raced.report["changed_while_read"] == [str(src)]
    assert raced.report["cache"]["key"] != old_key
    assert cache_mod.lookup(tmp_path / "b", old_key) is None  # nothing stored under the old content's key
    clean = run(src, tok, tmp_path / "c")  # the new content, prepared without a race
    assert raced.report["cache"]["key"] == clean.report["cache"]["key"]
    assert list(raced.train["input_ids"]) == list(clean.train["input_ids"])
    again = run(src, tok, tmp_path / "b")  # and a later run on the new content reuses the entry
    assert again.report["cache"]["hit"] is True and again.report["cache"]["key"] == clean.report["cache"]["key"]

    src.write_text(lines("old"))  # back to the old content: a fresh build, not the raced entry
    back = run(src, tok, tmp_path / "b")
    assert back.report["cache"]["hit"] is False and back.report["cache"]["key"] == old_key


@pytest.mark.parametrize("name", ["d.jsonl", "d.json", "d.csv", "d.txt"])
def test_readers_report_the_hash_of_the_bytes_they_read(tmp_path, name):
    p = tmp_path / name
    recs = [{"instruction": f"Say {i}.", "output": f"{i}"} for i in range(5)]
    p.write_text({"d.jsonl": "".join(json.dumps(r) + "\n" for r in recs), "d.json": json.dumps(recs),
                  "d.csv": "instruction,output\n" + "".join(f"{r['instruction']},{r['output']}\n" for r in recs), "d.txt": "some text\n"}[name])
    digests: dict = {}
    assert list(read_file(p, digests=digests))
    assert digests == {str(p): {"sha256": hashlib.sha256(p.read_bytes()).hexdigest(), "exact": True}}


def test_a_parquet_file_changed_while_read_is_an_error(tmp_path, tok, monkeypatch):
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = tmp_path / "d.parquet"
    recs = [{"instruction": f"Say {i}.", "output": f"{i} said"} for i in range(30)]
    pq.write_table(pa.Table.from_pylist(recs), src)
    real = prepare_mod.fingerprint

    def hash_then_change(s):
        out = real(s)
        pq.write_table(pa.Table.from_pylist([{**r, "output": r["output"] + "!"} for r in recs]), src)
        return out

    monkeypatch.setattr(prepare_mod, "fingerprint", hash_then_change)
    with pytest.raises(DataError, match="changed while it was being prepared"):
        run(src, tok, tmp_path / "b")
    assert not any((tmp_path / "b").iterdir())  # nothing cached
