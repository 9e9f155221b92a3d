"""Issue 35, point 8, on real training: a LoRA run at learning rate 30 ends near the uniform distribution (eval loss
close to ln(vocabulary)) yet a little below its baseline, so `beats_baseline` passes; `beats_trivial` fails it against
the uniform and unigram predictors and `diagnose` explains that failure. A healthy run at the usual rate passes."""

import json
import math

import pytest

from test_sft import make_config
from tiny import build_tiny_model
from trainpipe.cli import main
from trainpipe.report.diagnose import diagnose

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("m") / "base")


def _gates(run):
    return {r["name"]: r for r in json.loads((run / "gates.json").read_text())["results"]}


def test_a_collapsed_run_fails_beats_trivial_and_diagnose_says_why(tmp_path, base):
    cfg = make_config(tmp_path, base, **{"training.learning_rate": 30.0, "training.max_steps": 12, "training.eval_steps": 4,
                                         "training.loss_spike_factor": 0, "training.max_recoveries": 0, "eval.metrics": ["loss"]})
    assert main(["run", str(cfg)]) == 0  # gates.on_fail: warn
    run = tmp_path / "run"
    s = json.loads((run / "summary.json").read_text())
    t = s["trivial"]
    assert t["kind"] == "lm" and t["uniform_loss"] == pytest.approx(math.log(t["vocab_size"])) and t["eval_tokens"] > 0
    assert t["unigram_loss"] < t["uniform_loss"]
    assert s["final"]["loss"] > 0.9 * t["uniform_loss"]  # collapsed: near ln V
    g = _gates(run)
    assert g["beats_baseline"]["status"] == "pass"  # the figure that read as progress
    assert g["beats_trivial"]["status"] == "fail" and "collapsed" in g["beats_trivial"]["evidence"]
    failed = [n for n, r in g.items() if r["status"] == "fail"]
    kinds = [f.kind for f in diagnose(run)]
    assert all(f"gate_{n}" in kinds for n in failed) and "ok" not in kinds


def test_a_healthy_run_beats_the_trivial_predictors(tmp_path, base):
    cfg = make_config(tmp_path, base, **{"method.peft": "none", "eval.metrics": ["loss"], "training.max_steps": 40, "training.eval_steps": 20})  # full fine-tune: 3.06 vs unigram 3.77
    assert main(["run", str(cfg)]) == 0
    run = tmp_path / "run"
    s = json.loads((run / "summary.json").read_text())
    assert s["final"]["loss"] < s["trivial"]["unigram_loss"]
    assert _gates(run)["beats_trivial"]["status"] == "pass"
