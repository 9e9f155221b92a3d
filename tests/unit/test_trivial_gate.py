"""The `beats_trivial` gate (issue 35, point 8): the final model is compared with predictors that need no training
(uniform over the vocabulary and the training tokens' unigram frequencies for a language model; the majority class for
a classifier), and `diagnose` explains every failed gate instead of saying "Nothing to fix"."""

import json
import math

import pytest

from test_gates import make_run, results
from trainpipe.evaluate.metrics import trivial_classes, trivial_lm
from trainpipe.report.diagnose import diagnose


def test_trivial_lm_counts_the_loss_tokens_and_smooths_over_the_vocabulary():
    train = [{"input_ids": [9, 1, 1, 2], "labels": [-100, 1, 1, 2]}, {"input_ids": [9, 1, 3], "labels": [-100, -100, 3]}]
    held = [{"input_ids": [9, 1, 2], "labels": [-100, 1, 2]}]
    t = trivial_lm(train, held, vocab_size=10)
    # training loss tokens (after the shift): 1, 1, 2, 3 -> counts +1 over 10 tokens: p(1) = 3/14, p(2) = 2/14
    assert t["train_tokens_counted"] == 4 and t["eval_tokens"] == 2 and t["vocab_size"] == 10
    assert t["uniform_loss"] == pytest.approx(math.log(10))
    assert t["unigram_loss"] == pytest.approx(-(math.log(3 / 14) + math.log(2 / 14)) / 2)


def test_trivial_classes_is_the_majority_class_on_the_eval_split():
    t = trivial_classes(["a", "a", "b"], ["a", "b", "b", "b"])
    assert t["majority_class"] == "a" and t["majority_accuracy"] == 0.25 and t["classes"] == 2


def _with_trivial(run, final_loss=None, trivial=None, final=None):
    s = json.loads((run / "summary.json").read_text())
    s["trivial"] = trivial
    s["final"] = final if final is not None else {"loss": final_loss}
    s["baseline"] = {"loss": 6.0, "accuracy": 0.1}
    (run / "summary.json").write_text(json.dumps(s))
    return run


LM = {"kind": "lm", "vocab_size": 356, "uniform_loss": math.log(356), "unigram_loss": 3.7722, "eval_tokens": 181}


def test_a_collapsed_lm_passes_beats_baseline_but_fails_beats_trivial(tmp_path):
    run = _with_trivial(make_run(tmp_path), final_loss=5.7478, trivial=LM)  # the figures of a LoRA run at lr 30
    r = results(run)
    assert r["beats_baseline"].status == "pass"  # 6.0 -> 5.75 reads as progress ...
    g = r["beats_trivial"]
    assert g.status == "fail" and "uniform over 356 tokens 5.8749" in g.evidence and "collapsed" in g.evidence
    assert g.value == pytest.approx((3.7722 - 5.7478) / 3.7722)
    assert results(_with_trivial(run, final_loss=2.1, trivial=LM))["beats_trivial"].status == "pass"
    assert results(_with_trivial(run, final_loss=2.1, trivial=None))["beats_trivial"].status == "n/a"


def test_a_classifier_must_beat_the_majority_class(tmp_path):
    t = {"kind": "classes", "majority_class": "neg", "majority_accuracy": 0.7, "classes": 2, "eval_examples": 40}
    run = _with_trivial(make_run(tmp_path), trivial=t, final={"loss": 0.6, "accuracy": 0.7})
    g = results(run)["beats_trivial"]
    assert g.status == "fail" and "majority class `neg`: 70.0 %" in g.evidence
    assert results(_with_trivial(run, trivial=t, final={"loss": 0.6, "accuracy": 0.85}))["beats_trivial"].status == "pass"


def test_diagnose_explains_every_failed_gate_and_never_says_nothing_to_fix(tmp_path):
    run = make_run(tmp_path, effective=8)
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in (
        {"event": "run_started", "step": 0}, {"event": "training_started", "step": 0}, {"event": "run_finished", "step": 40, "wall_seconds": 3})))
    gates = {"passed": False, "failed": ["beats_trivial", "effective_batch"], "results": [
        {"name": "beats_trivial", "status": "fail", "evidence": "final eval loss 5.7478 against ..."},
        {"name": "effective_batch", "status": "fail", "evidence": "effective batch 8"},
        {"name": "dedup_ran", "status": "pass", "evidence": "ran"}]}
    (run / "gates.json").write_text(json.dumps(gates))
    found = diagnose(run)
    kinds = [f.kind for f in found]
    assert kinds.count("gate_beats_trivial") == 1 and kinds.count("gate_effective_batch") == 1 and "ok" not in kinds
    (f,) = [f for f in found if f.kind == "gate_beats_trivial"]
    assert "5.7478" in f.evidence and "training.learning_rate" in f.settings
    (run / "gates.json").write_text(json.dumps({**gates, "passed": True, "failed": [], "results": gates["results"][2:]}))
    assert [f.kind for f in diagnose(run)] == ["ok"]
