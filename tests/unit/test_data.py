"""Reading, format checks, bad lines, split and the accounting of every record."""

import json

import pytest

from tiny import alpaca_records, chat_records, write_jsonl
from trainpipe.config import DataConfig
from trainpipe.data import formats
from trainpipe.data.prepare import load_examples, prepare, split
from trainpipe.data.tokenize import setup_chat_template
from trainpipe.errors import DataError


@pytest.fixture()
def tok(tiny_tokenizer):
    setup_chat_template(tiny_tokenizer, "auto", "tiny")
    return tiny_tokenizer


def cfg(path, **kw):
    return DataConfig(sources=[{"path": str(path)}], **kw)


def test_detects_formats():
    assert formats.detect({"instruction": "a", "output": "b"}) == "alpaca"
    assert formats.detect({"messages": []}) == "chat"
    with pytest.raises(formats.FormatError, match="fits no known format"):
        formats.detect({"question": "a"})


def test_alpaca_input_and_system():
    msgs = formats.to_messages({"instruction": "Do", "input": "this", "output": "ok", "system": "Be brief."}, "alpaca")
    assert msgs == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Do\n\nthis"},
        {"role": "assistant", "content": "ok"},
    ]


def test_bad_json_line_names_file_line_and_excerpt(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", alpaca_records(5))
    lines = p.read_text().splitlines()
    lines.insert(2, '{"instruction": "broken", "output": ')
    p.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError) as info:
        load_examples(cfg(p))
    msg = info.value.message
    assert f"`{p}` line 3" in msg and "not valid JSON" in msg and '{"instruction": "broken"' in msg
    assert "data.on_error: skip" in msg


def test_missing_field_names_line(tmp_path):
    recs = alpaca_records(4)
    del recs[3]["output"]
    p = write_jsonl(tmp_path / "d.jsonl", recs)
    with pytest.raises(DataError, match=r"line 4: missing field `output` \(format alpaca\)"):
        load_examples(cfg(p))


def test_skip_counts_and_writes_rejected(tmp_path, tok):
    recs = alpaca_records(40)
    p = write_jsonl(tmp_path / "d.jsonl", recs)
    with open(p, "a") as fh:
        fh.write("not json at all\n")
        fh.write(json.dumps({"instruction": "x"}) + "\n")
        fh.write("[1, 2]\n")
    rej = tmp_path / "rejected.jsonl"
    data = prepare(cfg(p, on_error="skip", eval_split=4), tok, train_on="assistant", seed=0, rejected_path=rej)
    r = data.report
    assert r["rejected"] == {"invalid_json": 1, "format_mismatch": 1, "not_an_object": 1}
    assert r["lines_read"] == 43 and r["train_examples"] + r["eval_examples"] == 40
    rows = [json.loads(x) for x in rej.read_text().splitlines()]
    assert [row["line"] for row in rows] == [41, 42, 43] and all(row["reason"] for row in rows)


def test_too_long_examples_are_dropped_and_counted(tmp_path, tok):
    recs = alpaca_records(30)
    recs[0]["output"] = " ".join(["apple"] * 200)
    p = write_jsonl(tmp_path / "d.jsonl", recs)
    data = prepare(cfg(p, max_length=64, eval_split=3), tok, train_on="assistant", seed=0)
    assert data.report["dropped"] == {"too_long": 1}
    assert data.report["train_examples"] + data.report["eval_examples"] == 29
    assert all(len(x["input_ids"]) <= 64 for x in data.train + data.eval)


def test_split_is_deterministic_disjoint_and_sized(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", alpaca_records(100))
    ex, _, _ = load_examples(cfg(p))
    tr1, ev1 = split(ex, 0.1, seed=3)
    tr2, ev2 = split(ex, 0.1, seed=3)
    _, ev3 = split(ex, 0.1, seed=4)
    assert [e.line for e in ev1] == [e.line for e in ev2] and len(ev1) == 10 and len(tr1) == 90
    assert not {e.line for e in ev1} & {e.line for e in tr1}
    assert {e.line for e in ev1} != {e.line for e in ev3}
    _, ev = split(ex, 25, seed=3)
    assert len(ev) == 25


def test_chat_format_and_mixed_sources(tmp_path, tok):
    a = write_jsonl(tmp_path / "a.jsonl", alpaca_records(20))
    c = write_jsonl(tmp_path / "c.jsonl", chat_records(20))
    data = prepare(DataConfig(sources=[{"path": str(a)}, {"path": str(c)}], eval_split=4), tok, train_on="assistant", seed=0)
    assert [s["format"] for s in data.report["sources"]] == ["alpaca", "chat"]
    assert data.report["records"] == 40 and len(data.eval_generation) == 4


def test_bad_chat_role(tmp_path):
    recs = chat_records(3)
    recs[1]["messages"][1]["role"] = "human"
    p = write_jsonl(tmp_path / "c.jsonl", recs)
    with pytest.raises(DataError, match=r"line 2: messages\[1\]\.role must be one of"):
        load_examples(cfg(p))


def test_missing_data_file(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_examples(cfg(tmp_path / "nope.jsonl"))
