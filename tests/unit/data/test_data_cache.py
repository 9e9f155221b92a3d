"""The Arrow cache: reused when nothing changed, rebuilt when anything did, never reused after an interrupted write."""

import json

import pytest

from trainpipe.config import DataConfig
from trainpipe.data import cache as cache_mod
from trainpipe.data import build as build_mod
from trainpipe.data.prepare import prepare
from trainpipe.data.tokenize import setup_chat_template


@pytest.fixture()
def tok(tiny_tokenizer):
    setup_chat_template(tiny_tokenizer, "auto", "tiny")
    return tiny_tokenizer


@pytest.fixture()
def src(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps({"instruction": f"Say item {i}.", "output": f"item {i} said"}) + "\n" for i in range(40)))
    return p


def run(tmp_path, src, tok, **kw):
    cfg = DataConfig(sources=[{"path": str(src)}], eval_split=4, cache_dir=str(tmp_path / "cache"), **kw)
    return prepare(cfg, tok, train_on=kw.pop("train_on", "assistant"), seed=0)


def test_reused_when_unchanged_rebuilt_when_anything_changes(tmp_path, src, tok):
    first = run(tmp_path, src, tok)
    assert first.report["cache"]["hit"] is False
    again = run(tmp_path, src, tok)
    assert again.report["cache"]["hit"] is True and again.report["cache"]["key"] == first.report["cache"]["key"]
    assert list(again.train["input_ids"]) == list(first.train["input_ids"]) and again.eval == first.eval
    keys = {first.report["cache"]["key"]}
    for kw in ({"max_length": 512}, {"dedup": {"threshold": 0.9}}, {"pii": {"types": ["email"]}}, {"packing": "pack"}):
        r = run(tmp_path, src, tok, **kw).report
        assert r["cache"]["hit"] is False and r["cache"]["key"] not in keys, kw
        keys.add(r["cache"]["key"])
    other_seed = prepare(DataConfig(sources=[{"path": str(src)}], eval_split=4, cache_dir=str(tmp_path / "cache")), tok, train_on="assistant", seed=1)
    assert other_seed.report["cache"]["key"] not in keys
    src.write_text(src.read_text() + json.dumps({"instruction": "Say new.", "output": "new said"}) + "\n")
    changed = run(tmp_path, src, tok)
    assert changed.report["cache"]["hit"] is False and changed.report["records_read"] == 41
    tok.chat_template = tok.chat_template.replace("<|im_start|>assistant", "<|im_start|>assistant")  # same text: same key
    assert run(tmp_path, src, tok).report["cache"]["hit"] is True


def test_template_change_changes_the_key(tmp_path, src, tok):
    a = run(tmp_path, src, tok).report["cache"]["key"]
    setup_chat_template(tok, "alpaca", "tiny")
    try:
        b = run(tmp_path, src, tok).report["cache"]["key"]
    finally:
        setup_chat_template(tok, "chatml", "tiny")
    assert a != b


def test_interrupted_write_is_never_reused(tmp_path, src, tok, monkeypatch):
    real = cache_mod.Writer.write_json

    def boom(self, name, obj):
        if name == "eval_generation.json":
            raise KeyboardInterrupt  # killed midway through writing the entry
        return real(self, name, obj)

    monkeypatch.setattr(cache_mod.Writer, "write_json", boom)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path, src, tok)
    monkeypatch.setattr(cache_mod.Writer, "write_json", real)
    root = tmp_path / "cache"
    assert [p for p in root.iterdir()] == []  # the temporary folder is removed
    # a partial entry left by a hard kill (no COMPLETE marker, or a truncated file) is not used either
    fresh = run(tmp_path, src, tok)
    entry = fresh.cache_path
    with open(entry / "train.arrow", "r+b") as fh:
        fh.truncate(10)
    assert cache_mod.lookup(root, fresh.report["cache"]["key"]) is None
    rebuilt = run(tmp_path, src, tok)
    assert rebuilt.report["cache"]["hit"] is False and len(rebuilt.train) == len(fresh.train)
    (rebuilt.cache_path / "COMPLETE").unlink()
    assert cache_mod.lookup(root, rebuilt.report["cache"]["key"]) is None


def test_multiprocess_tokenization_gives_the_same_rows(tmp_path, src, tok):
    one = run(tmp_path, src, tok, num_proc=1)
    monkey = build_mod.CHUNK
    build_mod.CHUNK = 7
    try:
        two = prepare(DataConfig(sources=[{"path": str(src)}], eval_split=4, cache=False, cache_dir=str(tmp_path / "cache2"), num_proc=2), tok, train_on="assistant", seed=0)
    finally:
        build_mod.CHUNK = monkey
    assert list(two.train["input_ids"]) == list(one.train["input_ids"]) and list(two.train["labels"]) == list(one.train["labels"])
