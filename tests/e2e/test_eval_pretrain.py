"""Continued pretraining (`method.name: pretrain`) measures forgetting sets and the test split like `sft`: the
general text at baseline, at every in-training eval and at the end, with the alert exactly when its loss rose more
than the threshold; generated metrics are skipped on raw text (no reference replies) instead of reported as 0."""

import json
from pathlib import Path

import pytest

from test_pretrain import write_config
from trainpipe.cli import main

pytestmark = pytest.mark.e2e

GENERAL = Path(__file__).resolve().parent.parent / "assets" / "eval" / "forgetting" / "general.jsonl"


def test_pretrain_measures_forgetting_and_the_test_split(tmp_path, tiny_model_dir):
    import yaml

    cfg_path = write_config(tmp_path, tiny_model_dir, method={"peft": "none"}, steps=8, lr=3e-3)
    cfg = yaml.safe_load(cfg_path.read_text())
    cfg["data"]["test_split"] = 16
    cfg["data"]["pretrain_blocks"] = "document"  # one test row per record (the default `stream` joins the 16 into blocks)
    cfg["eval"] = {"metrics": ["loss", "perplexity", "rouge_l"], "forgetting": [{"path": str(GENERAL), "max_samples": 40}], "forgetting_threshold": 0.01}
    cfg_path.write_text(yaml.safe_dump(cfg))
    assert main(["run", str(cfg_path)]) == 0
    run = tmp_path / "run"
    s = json.loads((run / "summary.json").read_text())
    assert set(s["final"]) == {"loss", "perplexity"}  # no rouge_l of empty generations on raw text
    assert s["test"]["examples"] == 16 and s["test"]["loss"] < s["baseline"]["loss"]
    f = s["forgetting"]["sets"]["general"]
    assert f["change"] == pytest.approx(f["final"]["loss"] / f["baseline"]["loss"] - 1)
    hist = json.loads((run / "forgetting.json").read_text())["sets"]["general"]["history"]
    assert [(h["step"], h["phase"]) for h in hist] == [(0, "baseline"), (4, "train"), (8, "train"), (8, "final")]
    alerts = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines() if '"forgetting_detected"' in x]
    assert bool([a for a in alerts if a["phase"] == "final"]) == f["forgot"] == (f["change"] > 0.01)
