"""Issue 35, point 9: a DPO run's baseline pairs all tie (the policy is the reference), so `reward_accuracy`'s 0 % is
not "always wrong": ties are reported apart (`reward_ties`), chance (50 %) is shown, and the console table says the
change is not comparable instead of "+N pts". RL's `kl` and `kl_per_token` use one estimator (never negative)."""

import json

import pytest

from test_preference import write_config
from tiny import build_tiny_model, preference_records, write_jsonl
from trainpipe.cli import main
from trainpipe.evaluate.metrics import reading

pytestmark = pytest.mark.e2e


def test_reading_of_reward_accuracy():
    base = {"reward_accuracy": 0.0, "reward_ties": 1.0}
    r = reading("reward_accuracy", base, {"reward_accuracy": 0.31, "reward_ties": 0.0})
    assert not r["comparable"] and "below chance" in r["note"] and "69.0 % wrong" in r["note"] and "chance 50 %" in r["note"]
    r = reading("reward_accuracy", {"reward_accuracy": 0.4, "reward_ties": 0.0}, {"reward_accuracy": 0.8, "reward_ties": 0.1})
    assert r["comparable"] and "above chance" in r["note"] and "ties 10.0 %" in r["note"]
    assert reading("loss", base, {"loss": 1.0}) == {"comparable": True, "note": ""}


def test_dpo_baseline_ties_are_reported_apart(tmp_path, capsys):
    base = build_tiny_model(tmp_path / "base")
    write_jsonl(tmp_path / "data" / "pairs.jsonl", preference_records(120, seed=7))
    cfg = write_config(tmp_path, base, "dpo", {"name": "dpo"}, {"max_steps": 6, "eval_steps": 6})
    assert main(["run", str(cfg)]) == 0
    s = json.loads((tmp_path / "run-dpo" / "summary.json").read_text())
    b, f = s["baseline"], s["final"]
    assert b["reward_ties"] == 1.0 and b["reward_accuracy"] == 0.0  # 40 eval pairs, every one a tie
    assert f["reward_ties"] < 1.0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.strip("│ ").startswith("reward_accuracy"))
    assert "not comparable" in row and "pts" not in row
    assert "chance 50 %" in out and "not comparable to the baseline: 100 % of the baseline's pairs tie" in out
