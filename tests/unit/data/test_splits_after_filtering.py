"""Eval/test are drawn from the records that survive cleaning, dedup and the length rules, so `eval_split: N` gives
N eval records (seeded, deterministic); too few survivors stop the run with one paragraph below
`data.min_eval_records`. (On main the split was cut first: `eval_split: 100` gave 38 eval records.)"""

import json

import pytest

from trainpipe.config import DataConfig
from trainpipe.data.prepare import prepare
from trainpipe.data.split import split_indices, split_surviving
from trainpipe.data.tokenize import setup_chat_template
from trainpipe.errors import DataError


@pytest.fixture()
def tok(tiny_tokenizer):
    setup_chat_template(tiny_tokenizer, "auto", "tiny")
    return tiny_tokenizer


def alpaca(i: int, long: bool) -> dict:
    words = " ".join(f"w{i}x{k}" for k in range(400 if long else 3))
    return {"instruction": f"Question number {i} about topic {i * 7}?", "input": "", "output": f"Answer {i}: {words}"}


def write(path, recs):
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def run(tmp_path, tok, recs, name="d.jsonl", seed=0, **kw):
    src = write(tmp_path / name, recs)
    cfg = DataConfig(sources=[{"path": str(src)}], max_length=256, cache_dir=str(tmp_path / "c"), **kw)
    return prepare(cfg, tok, train_on="assistant", seed=seed)


def test_split_without_failures_is_the_plain_split():
    for strata in (None, [i % 3 for i in range(57)]):
        for e, t in ((0.1, 0), (5, 3), (20, 0.2)):
            plain = split_indices(57, e, t, 7, list(strata) if strata else None)
            kept = split_surviving(57, e, t, 7, lambda xs: [True] * len(xs), list(strata) if strata else None)
            assert kept[:3] == plain


def test_eval_size_is_met_when_most_records_are_too_long(tmp_path, tok):
    recs = [alpaca(i, long=i % 5 != 0) for i in range(300)]  # 60 short, 240 over max_length
    data = run(tmp_path, tok, recs, eval_split=30)
    rep = data.report
    assert rep["eval_examples"] == 30 and len(data.eval) == 30
    assert rep["held_out"]["eval_asked"] == 30 and rep["held_out"]["eval_records"] == 30
    assert rep["held_out"]["candidates_failed_length_rules"].get("too_long", 0) > 0
    assert rep["splits"]["train"]["records"] == 30  # the other 30 short ones; the long ones are dropped as too_long
    assert rep["dropped"]["too_long"] == 240
    assert rep["invariant"]["holds"]


def test_the_draw_is_deterministic_by_seed(tmp_path, tok):
    recs = [alpaca(i, long=i % 3 != 0) for i in range(150)]
    a = run(tmp_path / "a", tok, recs, eval_split=10, seed=1) if (tmp_path / "a").mkdir() is None else None
    b = run(tmp_path / "b", tok, recs, eval_split=10, seed=1) if (tmp_path / "b").mkdir() is None else None
    c = run(tmp_path / "c2", tok, recs, eval_split=10, seed=2) if (tmp_path / "c2").mkdir() is None else None
    ids = lambda d: [r["input_ids"] for r in d.eval]  # noqa: E731
    assert ids(a) == ids(b) and ids(a) != ids(c)
    assert len(a.eval) == len(c.eval) == 10


def test_too_few_survivors_stop_with_one_paragraph(tmp_path, tok):
    recs = [alpaca(i, long=i % 10 != 0) for i in range(100)]  # 10 short
    with pytest.raises(DataError) as e:
        run(tmp_path, tok, recs, eval_split=30)
    msg = str(e.value)
    assert "asked for 30" in msg and "only 10" in msg and "too_long" in msg and "min_eval_records" in msg
    assert "\n" not in msg


def test_eval_source_below_min_eval_records_stops_and_the_key_lowers_the_floor(tmp_path, tok):
    train = write(tmp_path / "t.jsonl", [alpaca(i, long=False) for i in range(40)])
    ev = write(tmp_path / "e.jsonl", [alpaca(1000 + i, long=i % 6 != 0) for i in range(30)])  # 5 of 30 fit
    srcs = [{"path": str(train)}, {"path": str(ev), "role": "eval"}]
    with pytest.raises(DataError, match=r"asked for 30.*only 5"):
        prepare(DataConfig(sources=srcs, max_length=256, cache_dir=str(tmp_path / "c")), tok, train_on="assistant", seed=0)
    data = prepare(DataConfig(sources=srcs, max_length=256, min_eval_records=5, cache_dir=str(tmp_path / "c")),
                   tok, train_on="assistant", seed=0)
    assert data.report["eval_examples"] == 5 and data.report["held_out"]["min_eval_records"] == 5
