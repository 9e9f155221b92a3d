"""Exact and near dedup across sources before the split, with the matched record recorded; decontamination."""

import json

import pytest

from trainpipe.config import DataConfig
from trainpipe.data.dedup import Contamination, NearDedup, Words, exact_key, jaccard
from trainpipe.data.prepare import prepare
from trainpipe.data.tokenize import setup_chat_template

BASE = ("the quick brown fox jumps over the lazy dog while the farmer watches from a distance and the sun sets slowly "
        "behind the distant hills painting the sky in shades of orange and purple")


@pytest.fixture()
def tok(tiny_tokenizer):
    setup_chat_template(tiny_tokenizer, "auto", "tiny")
    return tiny_tokenizer


def test_exact_key_ignores_case_whitespace_and_punctuation():
    w = Words()
    assert exact_key(w.ids("Hello,   World!")[0]) == exact_key(w.ids("hello world")[0])
    assert exact_key(w.ids("hello world")[0]) != exact_key(w.ids("hello there world")[0])


def test_near_dedup_finds_small_edits_not_distinct_texts():
    w = Words()
    nd = NearDedup(0.8, 3, 128)
    assert nd.check_and_add(0, w.ids(BASE)[1]) is None
    edited = BASE.replace("lazy", "sleepy")
    assert jaccard(BASE, edited) >= 0.8
    hit = nd.check_and_add(1, w.ids(edited)[1])
    assert hit is not None and hit[0] == 0 and hit[1] >= 0.8
    other = "a completely different sentence about databases indexes and query planners that shares nothing with the fox"
    assert nd.check_and_add(2, w.ids(other)[1]) is None


def test_contamination_by_ngram():
    w = Words()
    c = Contamination(13)
    c.add(w.ids(BASE)[1])
    assert c.hits(w.ids("prefix words " + " ".join(BASE.split()[5:20]) + " suffix")[1])
    assert not c.hits(w.ids(" ".join(BASE.split()[:12]))[1])  # 12 words < 13


def rec(i, text=None):
    return {"instruction": f"Describe scene {i}.", "output": text or f"scene {i}: " + " ".join(f"w{i}_{k}" for k in range(20))}


def test_dedup_runs_across_sources_before_the_split_and_records_matches(tmp_path, tok):
    a = [rec(i) for i in range(30)]
    b = [rec(i) for i in range(5)]  # exact copies of a[0:5] in another file
    b.append({"instruction": "Describe scene 7.", "output": a[7]["output"].replace("w7_3", "w7_X")})  # near copy
    pa, pb = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    pa.write_text("".join(json.dumps(r) + "\n" for r in a))
    pb.write_text("".join(json.dumps(r) + "\n" for r in b))
    data = prepare(DataConfig(sources=[{"path": str(pa)}, {"path": str(pb)}], eval_split=5, cache_dir=str(tmp_path / "c")), tok, train_on="assistant", seed=0)
    r = data.report
    assert r["dropped"] == {"exact_duplicate": 5, "near_duplicate": 1} and r["records_kept"] == 30
    dups = [json.loads(x) for x in (data.cache_path / "duplicates.jsonl").read_text().splitlines()]
    near = [d for d in dups if d["kind"] == "near"]
    assert near[0]["record"] == f"{pb}:6" and near[0]["matched"] == f"{pa}:8"
    assert {d["matched"] for d in dups if d["kind"] == "exact"} == {f"{pa}:{k}" for k in range(1, 6)}
    # nothing of eval is in train
    train_ids = {tuple(x) for x in data.train["input_ids"]}
    assert not any(tuple(e["input_ids"]) in train_ids for e in data.eval)


def test_decontamination_against_eval_source_and_benchmark_file(tmp_path, tok):
    train = [rec(i) for i in range(20)]
    leak = "the answer to the riddle is that the river always runs down to the sea in the end of every story told"
    train.append({"instruction": "Tell the riddle.", "output": "Well: " + leak})
    train.append({"instruction": "Quiz.", "output": "benchmark says " + BASE})
    ev = [{"instruction": "Riddle?", "output": leak}] + [rec(100 + i) for i in range(3)]
    p, pe, bench = tmp_path / "t.jsonl", tmp_path / "e.jsonl", tmp_path / "bench.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in train))
    pe.write_text("".join(json.dumps(r) + "\n" for r in ev))
    bench.write_text(json.dumps({"question": "q", "choices": [BASE]}) + "\n")
    cfg = DataConfig(sources=[{"path": str(p)}, {"path": str(pe), "role": "eval"}], cache_dir=str(tmp_path / "c"),
                     decontamination={"benchmarks": [str(bench)]})
    r = prepare(cfg, tok, train_on="assistant", seed=0).report
    assert r["dropped"] == {"decontaminated": 2} and r["splits"]["eval"]["records"] == 4 and r["splits"]["train"]["records"] == 20
    off = cfg.model_copy(update={"decontamination": cfg.decontamination.model_copy(update={"enabled": False})})
    assert prepare(off, tok, train_on="assistant", seed=0).report["splits"]["train"]["records"] == 22
