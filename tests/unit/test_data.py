"""Reading, format checks, bad lines, split and the accounting of every record."""

import json

import pytest

from tiny import chat_records, write_jsonl
from trainpipe.config import DataConfig
from trainpipe.data import formats
from trainpipe.data.prepare import prepare
from trainpipe.data.split import split_indices
from trainpipe.data.tokenize import setup_chat_template
from trainpipe.errors import DataError


@pytest.fixture()
def tok(tiny_tokenizer):
    setup_chat_template(tiny_tokenizer, "auto", "tiny")
    return tiny_tokenizer


def cfg(tmp_path, *paths, **kw):
    kw.setdefault("cache_dir", str(tmp_path / "cache"))
    return DataConfig(sources=[{"path": str(p)} for p in paths], **kw)


def distinct_alpaca(n: int) -> list[dict]:
    """Alpaca records with no two alike (the tiny task repeats itself, and dedup would drop repeats)."""
    return [{"instruction": "Reverse the order of the words.", "input": f"item{i} apple river", "output": f"river apple item{i}"} for i in range(n)]


def test_detects_formats_and_says_why():
    assert formats.detect({"instruction": "a", "output": "b"}) == ("alpaca", "it has `instruction` and `output` fields")
    assert formats.detect({"messages": []})[0] == "chat"
    with pytest.raises(formats.FormatError, match="fits no known format"):
        formats.detect({"question": "a"})


def test_alpaca_input_and_system():
    msgs = formats.to_messages({"instruction": "Do", "input": "this", "output": "ok", "system": "Be brief."}, "alpaca")
    assert msgs == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Do\n\nthis"},
        {"role": "assistant", "content": "ok"},
    ]


def test_bad_json_line_names_file_line_and_excerpt(tmp_path, tok):
    p = write_jsonl(tmp_path / "d.jsonl", distinct_alpaca(5))
    lines = p.read_text().splitlines()
    lines.insert(2, '{"instruction": "broken", "output": ')
    p.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError) as info:
        prepare(cfg(tmp_path, p), tok, train_on="assistant", seed=0)
    msg = info.value.message
    assert f"`{p}` line 3" in msg and "not valid JSON" in msg and '{"instruction": "broken"' in msg
    assert "data.on_error: skip" in msg


def test_missing_field_names_line(tmp_path, tok):
    recs = distinct_alpaca(4)
    del recs[3]["output"]
    p = write_jsonl(tmp_path / "d.jsonl", recs)
    with pytest.raises(DataError, match=r"line 4: missing field `output` \(format alpaca\)"):
        prepare(cfg(tmp_path, p), tok, train_on="assistant", seed=0)


def test_skip_counts_and_writes_rejected(tmp_path, tok):
    p = write_jsonl(tmp_path / "d.jsonl", distinct_alpaca(40))
    with open(p, "a") as fh:
        fh.write("not json at all\n")
        fh.write(json.dumps({"instruction": "x"}) + "\n")
        fh.write("[1, 2]\n")
    rej = tmp_path / "rejected.jsonl"
    data = prepare(cfg(tmp_path, p, on_error="skip", eval_split=4), tok, train_on="assistant", seed=0, rejected_path=rej)
    r = data.report
    assert r["rejected"] == {"invalid_json": 1, "format_mismatch": 1, "not_an_object": 1}
    assert r["records_read"] == 43 and r["records_kept"] == 40
    assert r["records_read"] == r["records_kept"] + sum(r["dropped"].values()) and r["invariant"]["holds"]
    rows = [json.loads(x) for x in rej.read_text().splitlines()]
    assert [row["line"] for row in rows] == [41, 42, 43] and all(row["reason"] for row in rows)


def test_too_long_examples_are_dropped_and_counted(tmp_path, tok):
    recs = distinct_alpaca(30)
    recs[0]["output"] = " ".join(f"apple{i}" for i in range(200))
    p = write_jsonl(tmp_path / "d.jsonl", recs)
    data = prepare(cfg(tmp_path, p, max_length=64, eval_split=3), tok, train_on="assistant", seed=0)
    assert data.report["dropped"] == {"too_long": 1}
    assert data.report["records_kept"] == 29
    assert all(len(x["input_ids"]) <= 64 for x in list(data.train) + data.eval)


def test_truncation_keeps_the_response_and_counts(tmp_path, tok):
    recs = distinct_alpaca(30)
    recs[0]["input"] = " ".join(f"stone{i}" for i in range(200))
    p = write_jsonl(tmp_path / "d.jsonl", recs)
    data = prepare(cfg(tmp_path, p, max_length=64, eval_split=3, truncation="truncate"), tok, train_on="assistant", seed=0)
    assert data.report["length"]["truncated"] == 1 and "too_long" not in data.report["dropped"]
    long = [x for x in list(data.train) + data.eval if len(x["input_ids"]) == 64]
    assert len(long) == 1
    trained = tok.decode([t for t, l in zip(long[0]["input_ids"], long[0]["labels"]) if l != -100])
    assert trained == "river apple item0<|im_end|>"


def test_split_is_deterministic_disjoint_and_sized():
    tr1, ev1, te1 = split_indices(100, 0.1, 0.0, seed=3)
    tr2, ev2, _ = split_indices(100, 0.1, 0.0, seed=3)
    _, ev3, _ = split_indices(100, 0.1, 0.0, seed=4)
    assert ev1 == ev2 and tr1 == tr2 and len(ev1) == 10 and len(tr1) == 90 and te1 == []
    assert not set(ev1) & set(tr1) and ev1 != ev3
    tr, ev, te = split_indices(100, 25, 0.2, seed=3)
    assert len(ev) == 25 and len(te) == 20 and len(tr) == 55 and not (set(ev) & set(te))


def test_split_stratified_keeps_shares():
    strata = ["a"] * 80 + ["b"] * 20
    _, ev, _ = split_indices(100, 0.1, 0.0, seed=0, strata=strata)
    assert len(ev) == 10 and sum(1 for i in ev if strata[i] == "b") == 2


def test_chat_format_and_mixed_sources(tmp_path, tok):
    a = write_jsonl(tmp_path / "a.jsonl", distinct_alpaca(20))
    c = write_jsonl(tmp_path / "c.jsonl", chat_records(20))
    data = prepare(cfg(tmp_path, a, c, eval_split=4), tok, train_on="assistant", seed=0)
    assert [s["format"] for s in data.report["sources"]] == ["alpaca", "chat"]
    assert "line 1" in data.report["sources"][1]["format_chosen_by"] and "messages" in data.report["sources"][1]["format_chosen_by"]
    assert data.report["records_read"] == 40 and len(data.eval_generation) == 4
    # the chat records repeat themselves: exact dedup ran across sources, and every record is accounted for
    r = data.report
    assert r["dropped"].get("exact_duplicate", 0) > 0 and r["records_kept"] + sum(r["dropped"].values()) == 40


def test_bad_chat_role(tmp_path, tok):
    recs = chat_records(3)
    recs[1]["messages"][1]["role"] = "human"
    p = write_jsonl(tmp_path / "c.jsonl", recs)
    with pytest.raises(DataError, match=r"line 2: messages\[1\]\.role must be one of"):
        prepare(cfg(tmp_path, p), tok, train_on="assistant", seed=0)


def test_missing_data_file(tmp_path, tok):
    with pytest.raises(DataError, match="does not exist"):
        prepare(cfg(tmp_path, tmp_path / "nope.jsonl"), tok, train_on="assistant", seed=0)
