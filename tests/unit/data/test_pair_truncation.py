"""Preference pairs over max_length are truncated as TRL's DPO does with `keep_end` (the prompt keeps its END within
its budget, the answer's header whole: issue 35; then the replies keep their start to fit), so they are kept; on main only the prompt was cut and a pair whose reply alone
was long was dropped (203 of 300 at max_length 384)."""

import json

import pytest

from trainpipe.config import DataConfig
from trainpipe.data.prepare import prepare
from trainpipe.data.tokenize import setup_chat_template, truncate_pair


@pytest.fixture()
def tok(tiny_tokenizer):
    setup_chat_template(tiny_tokenizer, "auto", "tiny")
    return tiny_tokenizer


def words(tag, n):
    return " ".join(f"{tag}{k}" for k in range(n))


def test_rule_keeps_prompt_end_and_fits_replies():
    prompt, replies = truncate_pair(list(range(300)), [list(range(1000, 1400)), list(range(2000, 2050))], 256)
    assert prompt == list(range(172, 300))  # the prompt budget: half of max_length, its end (the answer's header) kept
    assert replies[0] == list(range(1000, 1128)) and replies[1] == list(range(2000, 2050))
    short, reps = truncate_pair(list(range(20)), [list(range(1000, 1400)), list(range(2000, 2400))], 256)
    assert short == list(range(20)) and all(len(short) + len(r) <= 256 for r in reps)
    same, _ = truncate_pair(list(range(200)), [[7] * 300 + [1], [7] * 300 + [2]], 256)
    assert same is None  # chosen and rejected the same once cut: nothing to prefer


def test_long_pairs_are_kept_and_counted(tmp_path, tok):
    recs = [{"prompt": f"Case {i}: " + words(f"p{i}x", 120), "chosen": f"Good {i} " + words(f"c{i}x", 200),
             "rejected": f"Bad {i} " + words(f"r{i}x", 200)} for i in range(24)]
    src = tmp_path / "pairs.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in recs))
    cfg = DataConfig(sources=[{"path": str(src)}], max_length=256, truncation="truncate", eval_split=4, cache_dir=str(tmp_path / "c"))
    data = prepare(cfg, tok, train_on="assistant", seed=0)
    rep = data.report
    assert rep["dropped"].get("too_long", 0) == 0 and rep["records_kept"] == 24
    assert rep["length"]["truncated"] == 24
    for row in data.train:
        n = len(row["prompt_input_ids"])
        assert n + max(len(row["chosen_input_ids"]), len(row["rejected_input_ids"])) <= 256
        assert 0 < n <= 256 and len(row["chosen_input_ids"]) > 0
