"""Truncation never makes a broken example, and every dropped record is listed (issue 35, points 2-3).

- KTO examples shaped like LLaMA-Factory's `kto_en_demo` (multi-turn `messages` + `label`) at max_length 128: a long
  prompt is cut from its START (TRL's keep_end), so every kept row's prompt still ends with the answer's header
  (`<|im_start|>assistant\\n`), and the report says how many were truncated and by how many tokens;
- every filter (encoding, repetition, dedup, length) lists the record's file, line and rule in rejected.jsonl; a KTO
  example labelled undesirable (`label: false`) is never dropped for repeating itself (that is what it teaches)."""

import json

import pytest

from trainpipe.config import DataConfig
from trainpipe.data.prepare import prepare
from trainpipe.data.tokenize import setup_chat_template


@pytest.fixture()
def tok(tiny_tokenizer):
    setup_chat_template(tiny_tokenizer, "chatml", "tiny")
    return tiny_tokenizer


def words(tag, n):
    return " ".join(f"{tag}{k}" for k in range(n))


def _kto(i, long):
    turns = [{"role": "user", "content": f"Question {i}: " + (words(f"q{i}w", 70) if long else "what is two plus two?")},
             {"role": "assistant", "content": "An earlier answer " + (words(f"a{i}w", 30) if long else "four.")},
             {"role": "user", "content": f"And the follow-up {i}?"},
             {"role": "assistant", "content": f"Final answer {i}: yes."}]
    return {"messages": turns, "label": i % 2 == 0}


def test_kto_prompts_keep_their_end_and_the_answer_header(tmp_path, tok):
    recs = [_kto(i, long=i < 16) for i in range(32)]
    src = tmp_path / "kto.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in recs))
    data = prepare(DataConfig(sources=[{"path": str(src)}], max_length=128, eval_split=4, cache_dir=str(tmp_path / "c"), dedup={"near": False}),
                   tok, train_on="assistant", seed=0)
    rep = data.report
    header = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    rows = list(data.train) + list(data.eval)
    assert rep["records_kept"] == 32 and len(rows) == 32 and sum(rep["dropped"].values()) == 0
    assert rep["length"]["truncated"] == 16  # the 16 long prompts, none of the short ones
    assert rep["length"]["truncated_tokens"]["prompt"] > 16 * 50 and rep["length"]["truncated_tokens"]["replies"] == 0
    for row in rows:
        p = list(row["prompt_input_ids"])
        assert p[-len(header):] == header, tok.decode(p[-8:])  # the answer's header is never cut
        assert len(p) + len(row["completion_input_ids"]) <= 128
        assert "And the follow-up" in tok.decode(p)  # the turns nearest the answer are kept


def test_every_dropped_record_is_listed_with_file_line_and_rule(tmp_path, tok):
    loop = "the cat sat on the mat " * 4
    recs = [{"prompt": f"Say thing {i}.", "completion": f"Thing {i} is fine.", "label": True} for i in range(12)]
    recs[2] = {"prompt": "Say it twice.", "completion": loop, "label": True}  # repetitive and taught: dropped
    recs[3] = {"prompt": "Say it badly.", "completion": loop, "label": False}  # repetitive and undesirable: kept
    recs[4] = {"prompt": "Broken.", "completion": "caf\u00c3\u00a9 au lait", "label": True}  # mojibake
    recs[5] = dict(recs[0])  # an exact duplicate of line 1
    recs[6] = {"prompt": "Long. " + words("z", 400), "completion": words("y", 300), "label": True}  # no room once cut
    src = tmp_path / "kto.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in recs))
    rejected = tmp_path / "rejected.jsonl"
    data = prepare(DataConfig(sources=[{"path": str(src)}], max_length=96, truncation="drop", eval_split=2, cache_dir=str(tmp_path / "c"),
                              dedup={"near": False}), tok, train_on="assistant", seed=0, rejected_path=rejected)
    listed = [json.loads(x) for x in rejected.read_text().splitlines()]
    by_line = {r["line"]: r for r in listed}
    assert {r["line"]: r["kind"] for r in listed} == {3: "repetitive", 5: "bad_encoding", 6: "exact_duplicate", 7: "too_long"}
    assert all(r["source"] == str(src) and r["reason"] for r in listed)
    assert by_line[7]["stage"] == "length" and by_line[6]["stage"] == "dedup" and by_line[3]["stage"] == "filters"
    assert 4 not in by_line  # label: false, repetitive on purpose: kept
    assert data.report["dropped"] == {"repetitive": 1, "bad_encoding": 1, "exact_duplicate": 1, "too_long": 1}
    assert data.report["records_kept"] == 8
